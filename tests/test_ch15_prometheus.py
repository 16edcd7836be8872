"""Chapter 15 — the KV fragmentation gauge, the alert rules (promtool check + unit tests, and a broken rule that the
unit tests catch), and a real Prometheus scraping a running nanoserve on loopback.

promtool and prometheus are Debian's `prometheus` package (.ci/run installs it); without them these tests skip.
"""

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sequence import Sequence
from nanoserve.kv.block_manager import BlockManager
from nanoserve.sampling import SamplingParams
from nanoserve.server.metrics import kv_fragmentation
from tests.tiny_model import tiny_llama

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
needs_prometheus = pytest.mark.skipif(shutil.which("promtool") is None or shutil.which("prometheus") is None,
                                      reason="needs Debian's prometheus package: apt-get install prometheus")


def test_fragmentation_counts_the_empty_slots_of_held_blocks_once():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = Sequence("a", list(range(5)), 3), Sequence("b", list(range(10, 14)), 3)
    bm.allocate_slots("a", a.token_ids, 5)
    bm.allocate_slots("b", b.token_ids, 4)
    a.num_computed_tokens, b.num_computed_tokens = 5, 4
    assert kv_fragmentation([a, b], bm) == pytest.approx(3 / 12)  # a: 4 + 1 of 8 slots, b: 4 of 4
    c = Sequence("c", list(range(5)), 3)  # a fork of a: shares both blocks, counted once
    bm.fork("a", "c")
    c.num_computed_tokens = 5
    assert kv_fragmentation([a, b, c], bm) == pytest.approx(3 / 12)
    b.num_computed_tokens = 0  # allocated for this step's tokens, none computed yet
    assert kv_fragmentation([a, b, c], bm) == pytest.approx(7 / 12)
    assert kv_fragmentation([], bm) == 0.0


@needs_prometheus
def test_alert_rules_check_and_their_unit_tests_pass():
    check = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "alerts.yml")], capture_output=True, text=True)
    assert check.returncode == 0 and "6 rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run(["promtool", "test", "rules", str(DEPLOY / "alerts_test.yml")], capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    config = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr


@needs_prometheus
@pytest.mark.parametrize("old, new", [("> 0.3", "> 0.5"), ("> 0.5\n", "> 1.5\n"), ("for: 10m", "for: 30m"),
                                      ('{status="5xx"}', '{status="4xx"}'), ("== 1", "== 2"),
                                      ("> 0.1\n", "> 0.5\n"), ("for: 15m", "for: 30m")])
def test_the_unit_tests_catch_a_broken_rule(tmp_path, old, new):
    rules = (DEPLOY / "alerts.yml").read_text()
    assert old in rules
    (tmp_path / "alerts.yml").write_text(rules.replace(old, new, 1))
    shutil.copy(DEPLOY / "alerts_test.yml", tmp_path)
    test = subprocess.run(["promtool", "test", "rules", str(tmp_path / "alerts_test.yml")], capture_output=True, text=True)
    assert test.returncode != 0, f"the unit tests did not notice {old!r} -> {new!r}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


@needs_prometheus
def test_a_real_prometheus_scrapes_nanoserve():
    from nanoserve.server.runner import serving
    from nanoserve.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf()
    engine = LLMEngine(tiny_llama(vocab_size=49152, max_position_embeddings=1024),
                       EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=16),
                                    scheduler_config=SchedulerConfig(max_num_seqs=4)), tokenizer)
    with serving(engine, tokenizer, model_name="tiny") as (url, _), tempfile.TemporaryDirectory() as data:
        body = json.dumps({"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=30).read()
        port, target = free_port(), urllib.parse.urlparse(url).netloc
        config = Path(data) / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                          f"rule_files: [{DEPLOY / 'alerts.yml'}]\n"
                          f"scrape_configs:\n  - job_name: nanoserve\n    static_configs: [{{targets: ['{target}']}}]\n")
        prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}/tsdb",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        api = f"http://127.0.0.1:{port}/api/v1"
        try:
            deadline, samples = time.monotonic() + 180, []  # Prometheus starts slowly on a loaded machine
            while time.monotonic() < deadline:  # two scrapes: two samples in the last minute
                time.sleep(1)
                try:
                    q = urllib.parse.quote('count_over_time(nanoserve:generation_tokens_total[1m])')
                    samples = get_json(f"{api}/query?query={q}")["data"]["result"]
                except OSError:
                    continue  # not listening yet
                if samples and float(samples[0]["value"][1]) >= 2:
                    break
            assert samples and float(samples[0]["value"][1]) >= 2, "Prometheus did not scrape twice"
            q = urllib.parse.quote("nanoserve:generation_tokens_total")
            result = get_json(f"{api}/query?query={q}")["data"]["result"]
            assert result[0]["metric"]["model_name"] == "tiny" and result[0]["metric"]["job"] == "nanoserve"
            assert float(result[0]["value"][1]) == 3  # the one request's 3 tokens
            rules = get_json(f"{api}/rules")["data"]["groups"][0]["rules"]
            assert len(rules) == 6 and all(r["health"] == "ok" for r in rules), rules
        finally:
            prom.terminate()
            try:
                prom.wait(60)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
