"""Chapter 08 — rate limits and tenant quotas: token buckets, one per verified API key's tenant (or client address).

Each bucket holds up to `burst` tokens and refills at `rate` tokens per second; a request takes
one. With rate=2, burst=3: three requests at once pass, the fourth is refused (429) and told to
retry in 0.5 s, when the next token has dripped in.

    >>> limiter = TokenBucketLimiter(rate=2, burst=3)
    >>> [limiter.try_acquire("k", now=0.0) for _ in range(4)]
    [0.0, 0.0, 0.0, 0.5]

Who is a "key": the tenant of a *verified* API key, or the client's address when the server has no
keys — never a header the client may make up (a fresh `Authorization: Bearer x` per request would
be a fresh bucket, a fresh burst, every time). And the table stays bounded whatever the number of
clients: a bucket idle long enough to be full again is the same as no bucket, so it is dropped
(`burst / rate` seconds after its last use); past `max_keys` the least recently used one goes too.

A tenant (`--api-keys FILE`) has a requests/s bucket and a tokens-per-minute bucket (prompt + completion
tokens, `tokens_per_minute` of them refilling over a minute). A request *reserves* what it may cost at
admission — prompt + n × max_tokens, at most the whole quota — and is refused (429) if the bucket does not
hold that much; what it generates is paid from the reservation, and what it did not generate goes back
when it ends (a Reservation). So a burst cannot commit more than the quota: with 2,000 tokens a minute, of
three concurrent requests of n 16 × max_tokens 120 (+ a 20-token prompt: 1,940 each) the first is served and
the other two are refused, where charging tokens only as they came would have run all three (5,820 tokens).
Only a request that asks for more than the whole quota can overdraw it (it needs a full bucket to start);
the next then waits until the debt is paid.

Exercise 8.4 (exercises/08-http-serving/limits.py) writes TokenBucketLimiter.try_acquire, too_many_requests and
check_queue.
Chapter 15's scheduling policies read three more settings of a tenant: `weight` (its share under `fair`,
default 1) and `ttft_slo_ms` / `tpot_slo_ms` (its targets under `slo`, over the server's --slo-* defaults and
under a request's own fields). `scheduling_settings` turns the table into the engine's tenant_weights and
tenant_slos (EngineConfig): the scheduler knows tenants by name only, never keys.
"""

import json
import math
import time
import tomllib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from nanoserve.server.protocol import APIError


def too_many_requests(wait: float, message: str) -> APIError:
    """Exercise 8.4: the 429 for a request refused by a bucket that has what it needs in `wait` seconds.
    HTTP's Retry-After counts whole seconds: round up (a client told 0 would retry at once).

        >>> e = too_many_requests(0.5, "rate limit of 2 requests/s exceeded")
        >>> e.status, e.message, e.headers
        (429, 'rate limit of 2 requests/s exceeded; retry in 0.50 s', {'Retry-After': '1'})
    """
    return APIError(429, f"{message}; retry in {wait:.2f} s", headers={"Retry-After": str(max(1, math.ceil(wait)))})


def check_queue(num_waiting: int, max_waiting: int | None, retry_after_s: int) -> None:
    """Exercise 8.4: the bound on the waiting queue: requests with no completion running yet (vLLM's nearest,
    --max-num-queued-reqs, counts the running ones too). With `max_waiting` requests already waiting (None: no
    bound), the next one is a 503 with Retry-After: come back, or go elsewhere."""
    if max_waiting is not None and num_waiting >= max_waiting:
        raise APIError(503, f"the server is busy: {num_waiting} requests are waiting (max {max_waiting})",
                       headers={"Retry-After": str(retry_after_s)})


class TokenBucketLimiter:
    def __init__(self, rate: float, burst: float, max_keys: int = 10_000):
        if rate <= 0 or burst < 1 or max_keys < 1:
            raise ValueError(f"a rate limit needs rate > 0, burst >= 1 and max_keys >= 1, got rate={rate}, "
                             f"burst={burst}, max_keys={max_keys}")
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        # key -> (tokens, time of the last update), least recently used first
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _level(self, key: str, now: float) -> float:
        self._expire(now)
        tokens, last = self.buckets.pop(key, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def _store(self, key: str, tokens: float, now: float) -> None:
        self.buckets[key] = (tokens, now)  # at the end: the most recently used
        while len(self.buckets) > self.max_keys:
            self.buckets.popitem(last=False)

    def _expire(self, now: float) -> None:
        """Drop the buckets idle long enough to be full again (oldest first: the table is in use order)."""
        while self.buckets:
            tokens, last = next(iter(self.buckets.values()))
            if tokens + (now - last) * self.rate < self.burst:
                break
            self.buckets.popitem(last=False)

    def try_acquire(self, key: str, now: float | None = None, cost: float = 1.0) -> float:
        """Exercise 8.4: take `cost` tokens for `key`: 0.0 if granted, else the seconds until they will be there."""
        now = time.monotonic() if now is None else now
        tokens = self._level(key, now)
        if tokens >= cost:
            self._store(key, tokens - cost, now)
            return 0.0
        self._store(key, tokens, now)
        return (cost - tokens) / self.rate

    def wait_until_positive(self, key: str, now: float | None = None) -> float:
        """0.0 if `key`'s bucket is not in debt (an admission costs nothing yet), else the seconds until it is."""
        now = time.monotonic() if now is None else now
        tokens = self._level(key, now)
        self._store(key, tokens, now)
        return 0.0 if tokens > 0 else (1e-9 - tokens) / self.rate

    def charge(self, key: str, cost: float, now: float | None = None) -> None:
        """Take `cost` tokens whether or not they are there (the bucket may go into debt); a negative cost gives
        tokens back (a refund), never beyond the burst."""
        now = time.monotonic() if now is None else now
        self._store(key, min(self.burst, self._level(key, now) - cost), now)


@dataclass(frozen=True)
class Tenant:
    """One API key's owner and limits. None: no limit of that kind."""

    name: str
    requests_per_second: float | None = None
    burst: int = 10
    tokens_per_minute: int | None = None
    priority: int = 0  # the engine's: lower is served first (vLLM's convention)
    weight: float = 1.0  # chapter 15's fair policy: its share of each step's tokens, relative to the others
    ttft_slo_ms: float | None = None  # chapter 15's slo policy: its targets (None: the server's default)
    tpot_slo_ms: float | None = None
    # "tenant", or "operator": also reads /metrics and every tenant's requests in the engine view (chapter 12)
    role: str = "tenant"

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"


ROLES = ("tenant", "operator")


def load_api_keys(path: str | Path) -> dict[str, Tenant]:
    """`--api-keys FILE`, TOML or JSON (by its suffix): key -> tenant. Raises ValueError naming what is wrong.

        # keys.toml
        [keys."sk-team-a"]
        tenant = "team-a"
        requests_per_second = 5
        tokens_per_minute = 20000
        priority = 0
        weight = 2              # chapter 15: twice the share of a weight-1 tenant under --scheduling-policy fair
        ttft_slo_ms = 500       # chapter 15: its targets under --scheduling-policy slo
        tpot_slo_ms = 100

        [keys."sk-ops"]
        tenant = "ops"
        role = "operator"       # also reads /metrics and every tenant's requests in /engine (a tenant: its own)
    """
    path = Path(path)
    try:
        text = path.read_text()
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the API keys: {e}") from None
    return load_api_keys_dict(raw, str(path))


def load_api_keys_dict(raw, where: str = "api keys") -> dict[str, Tenant]:
    """The parsed form of an --api-keys file ({"keys": {key: {"tenant": ..., ...}}}) -> key -> Tenant."""
    keys = raw.get("keys") if isinstance(raw, dict) else None
    if not isinstance(keys, dict) or not keys:
        raise ValueError(f'{where}: expected a "keys" table mapping each API key to its tenant')
    tenants = {}
    for key, spec in keys.items():
        if not key.strip() or not isinstance(spec, dict) or not isinstance(spec.get("tenant"), str):
            raise ValueError(f"{where}: key {key[:4]}...: needs a table with a string `tenant`")
        unknown = set(spec) - {"tenant", "requests_per_second", "burst", "tokens_per_minute", "priority", "weight",
                               "ttft_slo_ms", "tpot_slo_ms", "role"}
        if unknown:
            raise ValueError(f"{where}: tenant {spec['tenant']!r}: unknown setting {sorted(unknown)[0]!r}")
        tenant = Tenant(spec["tenant"], spec.get("requests_per_second"), spec.get("burst", 10),
                        spec.get("tokens_per_minute"), spec.get("priority", 0), spec.get("weight", 1.0),
                        spec.get("ttft_slo_ms"), spec.get("tpot_slo_ms"), spec.get("role", "tenant"))
        if tenant.role not in ROLES:
            raise ValueError(f"{where}: tenant {tenant.name!r}: role must be one of {', '.join(ROLES)}, got {tenant.role!r}")
        for name in ("requests_per_second", "tokens_per_minute", "weight", "ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(tenant, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{where}: tenant {tenant.name!r}: {name} must be > 0, got {value!r}")
        if not isinstance(tenant.burst, int) or tenant.burst < 1 or not isinstance(tenant.priority, int):
            raise ValueError(f"{where}: tenant {tenant.name!r}: burst must be an int >= 1 and priority an int")
        tenants[key] = tenant
    return tenants


def prefix_cache_salt(tenant: str | None, requested: str | None) -> str | None:
    """Whose prefix cache a request reads and fills (LLMEngine.add_request's cache_salt).

    A request's own `cache_salt` (vLLM's field) is shared by every request that sends the same one, whoever
    sends it: the explicit way for tenants to share a public prefix (a system prompt they all use). Without one,
    a tenant's requests share with that tenant only; without tenants, everyone shares (None). The two kinds can
    never collide: a request cannot name another tenant's cache.

        >>> prefix_cache_salt("a", None), prefix_cache_salt("a", "tenant:b"), prefix_cache_salt(None, None)
        ('tenant:a', 'request:tenant:b', None)
    """
    if requested is not None:
        return f"request:{requested}"
    return None if tenant is None else f"tenant:{tenant}"


def scheduling_settings(tenants: dict[str, Tenant] | None) -> dict:
    """The tenants' weights and SLO targets, by tenant name, as EngineConfig's (and LLM's) keyword arguments;
    {} without tenants. A tenant whose keys disagree (two keys, two weights) is refused: whose would it be?

        >>> scheduling_settings({"k1": Tenant("a", weight=2, ttft_slo_ms=500), "k2": Tenant("b")})
        {'tenant_weights': {'a': 2, 'b': 1.0}, 'tenant_slos': {'a': SLOTargets(ttft_ms=500, tpot_ms=None)}}
    """
    from nanoserve.engine.policies import SLOTargets

    if not tenants:
        return {}
    weights, slos = {}, {}
    for t in tenants.values():
        slo = SLOTargets(t.ttft_slo_ms, t.tpot_slo_ms) if (t.ttft_slo_ms, t.tpot_slo_ms) != (None, None) else None
        if weights.get(t.name, t.weight) != t.weight or slos.get(t.name, slo) != slo:
            raise ValueError(f"tenant {t.name!r}: its keys give different weights or SLO targets")
        weights[t.name] = t.weight
        if slo is not None:
            slos[t.name] = slo
    return {"tenant_weights": weights, "tenant_slos": slos}


class TenantLimits:
    """The per-tenant buckets: requests/s, and tokens per minute. One table each, keyed by tenant name."""

    def __init__(self, tenants: dict[str, Tenant]):
        self.tenants = {t.name: t for t in tenants.values()}
        self.requests = {t.name: TokenBucketLimiter(t.requests_per_second, t.burst, 1)
                         for t in self.tenants.values() if t.requests_per_second}
        self.tokens = {t.name: TokenBucketLimiter(t.tokens_per_minute / 60, t.tokens_per_minute, 1)
                       for t in self.tenants.values() if t.tokens_per_minute}

    def admit(self, tenant: str) -> tuple[float, str]:
        """(0.0, "") to go ahead, else (seconds to wait, why)."""
        t = self.tenants[tenant]
        if tenant in self.requests:
            wait = self.requests[tenant].try_acquire(tenant)
            if wait:
                return wait, f"tenant {tenant!r}: rate limit of {t.requests_per_second:g} requests/s exceeded"
        if tenant in self.tokens:
            wait = self.tokens[tenant].wait_until_positive(tenant)
            if wait:
                return wait, f"tenant {tenant!r}: quota of {t.tokens_per_minute} tokens per minute spent"
        return 0.0, ""

    def charge(self, tenant: str | None, tokens: int, now: float | None = None) -> None:
        if tenant in self.tokens and tokens:
            self.tokens[tenant].charge(tenant, tokens, now)

    def reserve(self, tenant: str | None, tokens: int, now: float | None = None) -> "Reservation":
        """Take what a request may cost (at most the whole quota) from the tenant's tokens-per-minute bucket, or
        raise a 429 saying when it will be there. A tenant without a quota gets an empty Reservation."""
        bucket = self.tokens.get(tenant)
        if bucket is None:
            return Reservation(self, tenant, 0)
        take = min(tokens, bucket.burst)
        wait = bucket.try_acquire(tenant, now, cost=take)
        if wait:
            raise too_many_requests(wait, f"tenant {tenant!r}: this request may cost {tokens} tokens (prompt + n × "
                                          f"max_tokens); the quota of {bucket.burst:g} per minute has not that many left")
        return Reservation(self, tenant, take)


class Reservation:
    """The tokens a request took from its tenant's quota at admission. spend(k): k tokens it used (the prompt,
    then each generated token), paid from the reservation and, past it, charged as they come; close(): what is
    left goes back to the bucket (once, however often it is called).

        >>> limits = TenantLimits({"k": Tenant("t", tokens_per_minute=100)})
        >>> r = limits.reserve("t", 10 + 2 * 20, now=0.0)      # prompt 10, n 2 × max_tokens 20: 50 of 100
        >>> r.spend(10, now=0.0); r.spend(7, now=0.0); r.close(now=0.0)   # it stopped after 7 tokens: 33 back
        >>> round(limits.tokens["t"].buckets["t"][0])
        83
    """

    def __init__(self, limits: TenantLimits, tenant: str | None, tokens: int):
        self.limits, self.tenant, self.left = limits, tenant, tokens

    def spend(self, tokens: int, now: float | None = None) -> None:
        paid = min(tokens, self.left)
        self.left -= paid
        self.limits.charge(self.tenant, tokens - paid, now)

    def close(self, now: float | None = None) -> None:
        left, self.left = self.left, 0
        self.limits.charge(self.tenant, -left, now)
