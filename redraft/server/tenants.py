"""Tenants: API keys map to tenant names; each tenant has its own learned corpus.

Tenants never draft from each other's corpora: a replayed answer comes back several times faster, so shared
drafts would let one tenant learn, from timing alone, what another tenant asked and was answered (the reason
inference servers salt shared prefix caches per tenant).
"""

from __future__ import annotations

import hmac
import json
import re

DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # becomes a directory name under --corpus-dir


class TenantsError(ValueError):
    """A tenants file could not be used; the message names the file and what was expected."""


class Tenants:
    """Who may call the server.

    Args:
        keys: API key -> tenant name; None = an open server with one tenant, ``default``, and no key needed.
    """

    def __init__(self, keys: dict[str, str] | None = None) -> None:
        self.keys = dict(keys) if keys is not None else None

    @property
    def open(self) -> bool:
        return self.keys is None

    @property
    def names(self) -> list[str]:
        """Tenant names, sorted (one tenant may hold several keys)."""
        return [DEFAULT_TENANT] if self.keys is None else sorted(set(self.keys.values()))

    @classmethod
    def from_file(cls, path: str) -> Tenants:
        """Read a JSON object ``{"API_KEY": "tenant", ...}``.

        Raises:
            TenantsError: unreadable file, not JSON, not an object of non-empty strings, a tenant name that is not
                1-64 characters of letters, digits, ``_ . -`` starting with a letter or digit, or no keys.
        """
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise TenantsError(f"tenants file {path}: cannot read it ({e.strerror or e})") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TenantsError(f"tenants file {path}: not valid JSON ({e})") from e
        if not isinstance(data, dict) or not data:
            raise TenantsError(f'tenants file {path}: expected a JSON object {{"API_KEY": "tenant", ...}} '
                               "with at least one key")
        for key, name in data.items():
            if not key or not isinstance(name, str):
                raise TenantsError(f"tenants file {path}: every key must be a non-empty string mapped to a "
                                   f"tenant name string (got {key!r}: {name!r})")
            if not _NAME.match(name):
                raise TenantsError(f"tenants file {path}: tenant name {name!r} must be 1-64 letters, digits, "
                                   "'_', '.' or '-', starting with a letter or digit")
        return cls(data)

    def resolve(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer KEY`` header value, or None for a missing or unknown key.

        Keys are compared in constant time, each against every key, so response time says nothing about them.
        """
        if self.keys is None:
            return DEFAULT_TENANT
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        given = key.strip().encode()
        found = None
        for k, name in self.keys.items():
            if hmac.compare_digest(given, k.encode()):
                found = name
        return found
