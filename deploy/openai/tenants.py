"""API keys, the tenant each key belongs to, and each tenant's limits.

Keys come from `--api-key KEY` (one key, tenant "default") or `--api-keys-file FILE`, TOML or
JSON of one shape:

    secret = "..."                        # optional: the salt-derivation secret
    [keys]                                # key -> tenant
    "sk-acme-1" = "acme"
    [tenants.acme]                        # optional limits
    requests_per_second = 5
    tokens_per_minute = 20000
    kv_share = 0.25                       # of the device pool and of each tier: its cached blocks

A key is looked up by its SHA-256 digest and then compared with `hmac.compare_digest`, so the
time an answer takes does not depend on how much of a key a client guessed. Keys are never
logged or echoed.

A tenant's cache salt is derived here, HMAC-SHA256(secret, tenant name): a client cannot name
another tenant's salt, and its own `cache_salt` is nested under its tenant's
(`<tenant salt>|<client salt>`), so two tenants never share a block in any tier whatever they
send. kvcache/ charges eviction to the part of a salt before its first `|`: the tenant, whose
`kv_share` (written into its salt as `@SHARE`) caps what its cached blocks hold of the device
pool, of the CPU tier and of this engine's SSD record (kvcache/tenants.py TierShares).
The secret is the file's `secret`, else random per process: give every server in front of one
deployment (and an SSD tier meant to outlive a restart) the same file.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import time
from dataclasses import dataclass, field

from tierserve.deploy.openai.errors import ApiError

__all__ = ["TenantLimits", "Tenant", "KeyTable", "TokenBucket", "SALT_SEPARATOR",
           "namespace_of"]

SALT_SEPARATOR = "|"
_LIMIT_FIELDS = {"requests_per_second", "tokens_per_minute", "kv_share"}


@dataclass(frozen=True)
class TenantLimits:
    requests_per_second: float | None = None
    tokens_per_minute: float | None = None
    kv_share: float | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_second", "tokens_per_minute"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not 0 < v < math.inf):
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        share = self.kv_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise ValueError(f"kv_share must be in (0, 1], got {share!r}")


class TokenBucket:
    """`rate` units a second up to `capacity`; a level below zero is debt that refuses until
    it is paid back."""

    __slots__ = ("rate", "capacity", "level", "stamp")

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.level, self.stamp = capacity, time.monotonic()

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, need: float, now: float) -> float:
        """Seconds until `need` units are there (0: now)."""
        self._refill(now)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, n: float, now: float | None = None) -> None:
        self._refill(time.monotonic() if now is None else now)
        self.level -= n


@dataclass
class Tenant:
    name: str
    salt: str
    limits: TenantLimits
    requests: TokenBucket | None = field(default=None, repr=False)
    tokens: TokenBucket | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        rps, tpm = self.limits.requests_per_second, self.limits.tokens_per_minute
        if rps is not None:
            self.requests = TokenBucket(rps, max(1.0, rps))
        if tpm is not None:
            self.tokens = TokenBucket(tpm / 60.0, tpm)

    def admit(self, num_requests: int) -> None:
        """Takes num_requests from the request bucket; 429 with Retry-After when the tenant is
        over either rate (a token debt refuses until it is paid back)."""
        now = time.monotonic()
        wait = 0.0
        if self.requests is not None:
            wait = self.requests.wait(num_requests, now)
        if self.tokens is not None:
            wait = max(wait, self.tokens.wait(1e-9, now))
        if wait > 0:
            limit = "requests per second" if self.requests is not None and \
                self.requests.level < num_requests else "tokens per minute"
            raise ApiError(429, f"tenant {self.name!r} is over its {limit}; retry after "
                           f"{wait:.2f} s", headers={"Retry-After": str(max(1, math.ceil(wait)))})
        if self.requests is not None:
            self.requests.take(num_requests, now)

    def charge(self, num_tokens: int) -> None:
        if self.tokens is not None and num_tokens:
            self.tokens.take(num_tokens)

    def cache_salt(self, client_salt: str | None) -> str:
        return self.salt if client_salt is None else \
            f"{self.salt}{SALT_SEPARATOR}{client_salt}"


class KeyTable:
    """Key digests -> tenants; `authenticate` answers a request's Authorization header."""

    def __init__(self, keys: dict[str, str], limits: dict[str, TenantLimits] | None = None,
                 secret: bytes | None = None) -> None:
        if not keys:
            raise ValueError("an API key table needs at least one key")
        limits = limits or {}
        unknown = set(limits) - set(keys.values())
        if unknown:
            raise ValueError(f"limits for tenants no key belongs to: {sorted(unknown)}")
        secret = secret or os.urandom(32)
        self.tenants: dict[str, Tenant] = {}
        for name in sorted(set(keys.values())):
            if not isinstance(name, str) or not name:
                raise ValueError(f"a tenant name is a non-empty string, got {name!r}")
            salt = "t-" + hmac.new(secret, name.encode(), hashlib.sha256).hexdigest()[:32]
            limit = limits.get(name, TenantLimits())
            if limit.kv_share is not None:  # kvcache reads a tenant's share from its salt
                salt += f"@{limit.kv_share:g}"
            self.tenants[name] = Tenant(name, salt, limit)
        self._by_digest: dict[bytes, tuple[bytes, Tenant]] = {}
        for key, name in keys.items():
            if not isinstance(key, str) or not key:
                raise ValueError("an API key is a non-empty string")
            digest = hashlib.sha256(key.encode()).digest()
            self._by_digest[digest] = (key.encode(), self.tenants[name])

    @classmethod
    def single(cls, key: str) -> "KeyTable":
        return cls({key: "default"})

    @classmethod
    def from_file(cls, path: str) -> "KeyTable":
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"cannot read the API keys file: {e}") from None
        if path.endswith(".json"):
            data = json.loads(raw)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ValueError(f"{path}: TOML key files need Python >= 3.11; use JSON "
                                 f"(a .json file)") from None
            data = tomllib.loads(raw.decode())
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: dict, where: str = "the key table") -> "KeyTable":
        unknown = set(data) - {"keys", "tenants", "secret"}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)} (keys, tenants, secret)")
        limits = {}
        for name, fields in (data.get("tenants") or {}).items():
            bad = set(fields) - _LIMIT_FIELDS
            if bad:
                raise ValueError(f"{where}: tenants.{name}: unknown limits {sorted(bad)}; "
                                 f"known: {sorted(_LIMIT_FIELDS)}")
            limits[name] = TenantLimits(**fields)
        secret = data.get("secret")
        return cls(dict(data.get("keys") or {}), limits,
                   secret.encode() if isinstance(secret, str) and secret else None)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of a `Bearer KEY` header; 401 without one or with an unknown key."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "no API key: send the header 'Authorization: Bearer KEY'")
        presented = key.strip().encode()
        found = self._by_digest.get(hashlib.sha256(presented).digest())
        if found is None or not hmac.compare_digest(found[0], presented):
            raise ApiError(401, "the API key is not valid")
        return found[1]


def namespace_of(request, tenant: Tenant | None) -> str:
    """The namespace of a client's own request ids and stored responses: its tenant, else its
    address."""
    if tenant is not None:
        return f"{tenant.name}:"
    return f"{request.client.host if request.client else ''}:"
