"""Chapter 16 — tensor parallelism across "nodes" with the standard launcher: two torchrun launchers on
one machine (rendezvous on loopback), one rank each, TP 2; the greedy tokens must equal TP 1's in this
process (chapter 11's worker code on the other rank)."""

import json
import os
import subprocess
import sys

from nanoserve.distributed.multiproc import free_port
from tests.tiny_model import tiny_llama
from tests.torchrun_tp import greedy_tokens


def test_two_launchers_tp2_match_tp1(tmp_path):
    port = free_port("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "tokens.json"
    launchers = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                   "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                                   "--master-port", str(port), "tests/torchrun_tp.py", str(out), "2"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for node in (0, 1)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in launchers] == [0, 0], logs
    tp2 = json.loads(out.read_text())
    assert tp2 == greedy_tokens(tiny_llama(), 1)
    assert len(set(map(tuple, tp2))) == 3  # three prompts, three different continuations: not a degenerate model
