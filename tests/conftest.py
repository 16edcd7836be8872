"""Shared fixtures. The real model and its transformers twin load once per test session."""

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """Our float32 SmolLM2-135M-Instruct, loaded from the embedded GGUF."""
    from nanoserve.model import load_gguf

    return load_gguf()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """Our tokenizer of the embedded GGUF."""
    from nanoserve.tokenizer import Tokenizer

    return Tokenizer.from_gguf()


@pytest.fixture(scope="session")
def hf_model():
    """The independent oracle: transformers' LlamaForCausalLM, loading the very same GGUF itself
    (its own dequantizer, its own un-permutation of Q/K)."""
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
