"""Chapter 16 — the ingress's GET /metrics: its own HTTP and tenant counters, and every replica's engine series,
each labelled with its replica, so a user who scrapes the address they serve on gets the fleet:

    nanoserve:http_responses_total{model_name="m",status="2xx"} 5.0                 the ingress's own
    nanoserve:num_requests_running{model_name="m",replica="r1a2"} 1.0               replica r1a2's gauge
    nanoserve:num_requests_running{model_name="m",replica="x9k3"} 0.0               replica x9k3's
    nanoserve:request_success_total{finished_reason="stop",model_name="m",replica="r1a2"} 3.0

Each scrape reads the replicas' own /metrics (replica.py; listed by `replica_metrics_urls`), which stay there for
a fleet's scraper that reads them one by one; a replica that does not answer within `timeout_s` is left out
of this scrape (it died, or is starting). The ingress runs no engine, so chapter 08's engine series of its own
registry (always 0 here) are not exported.
"""

import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.server.metrics import PrometheusStatLogger

INGRESS_FAMILIES = ("nanoserve:http_responses", "nanoserve:tenant_requests", "nanoserve:tenant_tokens")


def labelled(text: str, replica: str) -> list:
    """A replica's scrape as metric families, every sample with replica=`replica` added (the ingress's own
    families left out: a replica serves no HTTP and has no tenants)."""
    families = []
    for family in text_string_to_metric_families(text):
        if family.name in INGRESS_FAMILIES:
            continue
        family.samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
        families.append(family)
    return families


class _Families:
    """A prometheus_client collector over a fixed list of families (one scrape's)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families


class FleetStatLogger(PrometheusStatLogger):
    def __init__(self, model_name: str, replica_urls, compat: str | None = None, timeout_s: float = 2.0):
        """replica_urls() -> {replica id: its /metrics URL}."""
        super().__init__(model_name, compat)
        self.replica_urls, self.timeout_s = replica_urls, timeout_s

    def fetch(self, url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                return response.read().decode()
        except OSError:  # the replica died or is not up yet: this scrape goes without it
            return None

    def scrape(self) -> bytes:
        families = {f.name: f for f in self.registry.collect() if f.name in INGRESS_FAMILIES}
        for replica, url in sorted(self.replica_urls().items()):
            text = self.fetch(url)
            for family in labelled(text, replica) if text is not None else ():
                if family.name in families:  # the same series from another replica: one family, more samples
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(list(families.values())))
        return generate_latest(registry)
