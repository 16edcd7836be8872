"""Shared fixtures. The real model and its transformers twin load once per test session."""

import os

# Chapter 07's kernels run on the CPU in Triton's interpreter, which must be on before triton itself is first
# imported — transformers imports it, and a kernel launched in an interpreter switched on later cannot call
# Triton's own @triton.jit library functions, tl.zeros or tl.max ("Cannot call @triton.jit'd outside of the scope
# of a kernel").
os.environ.setdefault("TRITON_INTERPRET", "1")

# make test's two pytest-xdist workers share the machine's two cores: one thread each, for the tests and for
# what they start (a server, a CLI, a notebook's kernel), so that no OpenMP pool waits on a thread the other
# worker holds. Set before torch is first imported, which reads it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

# Chapter 16's local Ray listens on loopback only if RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is "0" before Ray is first
# imported (some test modules import ray.exceptions themselves): nanoserve.cluster sets it.
import nanoserve.cluster  # noqa: E402, F401

import pytest
import torch

# An HTTP call that names no timeout gets httpx's default, 5 s: short for a test server on a loaded two-core CI
# machine (a tenth of that here), and such a timeout fails a test for the machine's load, not for a defect. The tests
# that time out on purpose name their own (e.g. timeout=0.5). httpx.get/post/stream and Client() take this object
# as their default, so raising it here raises every default; if httpx ever moves it, the tests keep httpx's 5 s.
try:
    from httpx._config import DEFAULT_TIMEOUT_CONFIG as _HTTPX_DEFAULT_TIMEOUT

    _HTTPX_DEFAULT_TIMEOUT.connect = _HTTPX_DEFAULT_TIMEOUT.read = 60.0
    _HTTPX_DEFAULT_TIMEOUT.write = _HTTPX_DEFAULT_TIMEOUT.pool = 60.0
except (ImportError, AttributeError):
    pass

# make test's units of work under pytest-xdist, handed out longest first so that the two workers finish together:
# the Ray group (one local Ray at a time: chapter 16's fleet tests and its notebook), each notebook, each chapter's
# stub grading, then one test file per unit (its module fixtures built once).
RAY_GROUP = ("tests/test_ch16_replicas.py", "tests/test_notebooks.py::test_notebook_runs[16-beyond-one-server]")
ONE_TEST_UNITS = ("tests/test_notebooks.py::test_notebook_runs[",
                  "tests/test_exercises.py::test_stubs_score_zero_with_not_implemented[")


def work_unit(nodeid: str) -> tuple[int, str]:
    """(rank, unit) of a test: rank 0 is handed out first."""
    if nodeid.startswith(RAY_GROUP):
        return 0, "ray"
    for rank, prefix in enumerate(ONE_TEST_UNITS, start=1):
        if nodeid.startswith(prefix):
            return rank, nodeid
    return len(ONE_TEST_UNITS) + 1, nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    """In an xdist worker (each collects), the order the units are handed out in (stable within a rank)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: work_unit(item.nodeid)[0])


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling (a unit goes to one worker whole; units in collection order with make test's
    --no-loadscope-reorder), its scopes being work_unit's."""
    from xdist.scheduler import LoadScopeScheduling

    class CourseScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)[1]

    return CourseScheduling(config, log)


@pytest.fixture(autouse=True)
def graded_exercise(request, monkeypatch):
    """A graded test's exercise id in NANOSERVE_EXERCISE: `implementation()` then grades that rung of a
    ladder alone (nanoserve/student.py, RUNGS)."""
    marker = request.node.get_closest_marker("exercise")
    if marker:
        monkeypatch.setenv("NANOSERVE_EXERCISE", marker.args[0])


@pytest.fixture(scope="session")
def smollm2():
    """Our float32 SmolLM2-135M-Instruct, loaded from the embedded GGUF."""
    from nanoserve.model import load_gguf

    return load_gguf()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """Our tokenizer of the embedded GGUF."""
    from nanoserve.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf()


@pytest.fixture(scope="session")
def hf_model():
    """The independent oracle: transformers' LlamaForCausalLM, loading the very same GGUF itself (its own
    un-permutation of Q/K, its own names, its own forward pass). It dequantizes with the same gguf.dequantize as
    load_gguf, so the decoding is checked apart, by hand (test_gguf_blocks_decode_by_hand_to_the_loaded_weights)."""
    from transformers import AutoModelForCausalLM

    from nanoserve.model import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from nanoserve.model import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory):
    """Chapter 19: two PEFT adapters trained (a few steps) on the tiny random model, once per session:
    `a` on every projection (rank 4), `b` on q, v and down (rank 8). {name: directory}."""
    from tests.lora_reference import ADAPTER_SPECS, hf_twin, tiny_llama, train_tiny_adapters

    return train_tiny_adapters(hf_twin(tiny_llama()), tmp_path_factory.mktemp("lora"), ADAPTER_SPECS)
