"""dgr.transport.security: credentials files, tokens (forgery, skew, replay), the session
table's owners and caps, and the worker's secure default. No model, no network."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dgr import errors
from dgr.transport.security import (
    AUTH_MAGIC,
    DENIED,
    Credential,
    KeyRing,
    Security,
    parse_credentials,
    pick,
    sign,
)
from dgr.worker.sessions import SessionTable

A = Credential("acme", b"a" * 20, max_sessions=2)
B = Credential("beta", b"b" * 20)
P = Credential("workers", b"p" * 20, peer=True)


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_credentials_file():
    creds = parse_credentials("""
        # name  secret  options
        workers 0123456789abcdef0123 peer
        acme    fedcba9876543210fedc sessions=8 queued=32   # a tenant
    """)
    assert [c.name for c in creds] == ["workers", "acme"]
    assert creds[0].peer and not creds[1].peer
    assert (creds[1].max_sessions, creds[1].max_queued) == (8, 32)
    assert "fedcba" not in repr(creds[1])  # the secret is never shown
    assert pick(creds, prefer_peer=True).name == "workers" and pick(creds).name == "workers"
    assert pick(creds, "acme").name == "acme"
    with pytest.raises(errors.InvalidArgument, match="no credential named"):
        pick(creds, "nobody")


def test_a_credentials_file_others_may_read_is_warned_of(tmp_path, caplog):
    from dgr.transport.security import load_credentials

    f = tmp_path / "keys"
    f.write_text("acme 0123456789abcdef0123\n")
    f.chmod(0o600)
    assert load_credentials(str(f))[0].name == "acme" and "chmod" not in caplog.text
    f.chmod(0o644)
    load_credentials(str(f))
    assert "chmod 600" in caplog.text and "0123456789" not in caplog.text
    with pytest.raises(errors.InvalidArgument, match="cannot read"):
        load_credentials(str(tmp_path / "missing"))


@pytest.mark.parametrize("text,why", [
    ("", "holds no credential"),
    ("acme", "expected 'name secret"),
    ("acme short", "shorter than 16"),
    ("ac.me 0123456789abcdef0", "a name is"),
    ("acme 0123456789abcdef0 sessions=0", "unknown option"),
    ("acme 0123456789abcdef0 admin", "unknown option"),
    ("acme 0123456789abcdef0\nacme 0123456789abcdef1", "given twice"),
])
def test_bad_credentials_files_are_refused_without_showing_a_secret(text, why):
    with pytest.raises(errors.InvalidArgument, match=why) as e:
        parse_credentials(text)
    assert "0123456789abcdef" not in str(e.value)


def _forged(token: str) -> str:
    """``token`` with the last hex digit of its MAC changed (always to another digit: setting
    it to "0" left one token in 16 unchanged, and valid)."""
    return token[:-1] + ("1" if token[-1] == "0" else "0")


def test_a_token_proves_the_secret_once_within_the_window():
    clock = Clock()
    ring = KeyRing([A, B, P], skew=60, clock=clock)
    tok = sign(A, "data", now=clock.t)
    assert ring.verify(tok, "data") is A
    with pytest.raises(errors.Unauthenticated) as e:  # replayed
        ring.verify(tok, "data")
    assert str(e.value) == DENIED
    refused = [
        None, "", "x" * 600, "dgr1.acme", tok.replace("dgr1", "dgr2"),
        sign(A, "grpc:/dgr.v1.Shard/Describe", now=clock.t),  # another purpose
        sign(Credential("acme", b"z" * 20), "data", now=clock.t),  # wrong secret
        sign(Credential("eve", b"a" * 20), "data", now=clock.t),  # unknown name
        sign(A, "data", now=clock.t - 61), sign(A, "data", now=clock.t + 61),  # skewed
        _forged(sign(A, "data", now=clock.t)),  # a forged MAC
    ]
    for t in refused:
        with pytest.raises(errors.Unauthenticated):
            ring.verify(t, "data")
    assert ring.refused == len(refused) + 1
    # within the window a fresh token works; the seen nonces age out with the window
    assert ring.verify(sign(B, "data", now=clock.t + 30), "data") is B
    clock.t += 200
    ring.verify(sign(A, "data", now=clock.t), "data")
    assert len(ring._seen) == 1


def test_the_nonce_store_is_bounded():
    clock = Clock()
    ring = KeyRing([A], skew=60, clock=clock, max_nonces=3)
    for _ in range(3):
        ring.verify(sign(A, "data", now=clock.t), "data")
    with pytest.raises(errors.Unauthenticated):  # full: refused until the old ones age out
        ring.verify(sign(A, "data", now=clock.t), "data")
    clock.t += 61
    assert ring.verify(sign(A, "data", now=clock.t), "data") is A


def test_the_auth_frame():
    sec = Security(A, KeyRing([A, B]))
    frame = sec.auth_frame()
    assert frame.startswith(AUTH_MAGIC) and b"a" * 20 not in frame
    assert sec.verify_auth_frame(frame) is A
    for bad in (frame, b"DGRF" + frame[4:], b""):  # replayed, not an auth frame, empty
        with pytest.raises(errors.Unauthenticated):
            sec.verify_auth_frame(bad)
    assert Security().auth_frame() is None and Security().metadata("/x") is None


class _Engine:
    def release(self, slot):
        pass


def test_sessions_belong_to_their_credential_and_are_capped_per_credential():
    t = SessionTable(_Engine(), 8, 64, evict_after=3600)

    def step(session, pos, who=None):
        t.commit(t.acquire(session, 1, pos, 1, who))

    step("a1", 0, A)
    step("a2", 0, A)
    with pytest.raises(errors.ResourceExhausted, match="'acme' holds 2 sessions"):
        t.acquire("a3", 1, 0, 1, A)  # A's cap (2), though slots are free
    step("b1", 0, B)  # B is not held back
    # another tenant can neither step nor release A's session
    with pytest.raises(errors.SessionForbidden):
        t.acquire("a1", 1, 1, 1, B)
    assert t.release("a1", B) is False and "a1" in t
    step("a1", 1, P)  # a peer (the previous stage, relaying) may step it
    step("a1", 2, A)  # and so may its owner
    assert t.release("a1", A) is True and t.owned("acme") == 1
    step("a3", 0, A)  # a session freed: A may open one again
    # a session a peer opened (relayed here) may be released by the tenant's driver, but
    # not stepped by a tenant
    step("r1", 0, P)
    with pytest.raises(errors.SessionForbidden):
        t.acquire("r1", 1, 1, 1, B)
    assert t.release("r1", B) is True
    # a relayed session its driver now steps itself, under a new epoch (its recovery, the
    # gRPC path): the tenant takes it over from an empty cache, within its cap
    step("r2", 0, P)
    with pytest.raises(errors.ResourceExhausted):  # acme holds its 2 already
        t.acquire("r2", 2, 0, 1, A)
    with pytest.raises(errors.SessionForbidden):  # not under the same epoch: its cache
        t.acquire("r2", 1, 1, 1, B)
    t.commit(t.acquire("r2", 2, 0, 1, B))  # beta has no cap
    assert t.get("r2").owner == "beta" and t.get("r2").epoch == 2 and t.owned("beta") == 2
    with pytest.raises(errors.SessionForbidden):  # and now it is beta's
        t.acquire("r2", 3, 0, 1, A)
    # without credentials (who=None) nothing is checked
    step("x", 0)
    assert t.release("x") is True


def test_the_table_wide_default_cap_applies_to_credentials_without_their_own():
    t = SessionTable(_Engine(), 4, 64, evict_after=3600)
    t.max_sessions_per_owner = 1
    t.acquire("b1", 1, 0, 1, B)
    with pytest.raises(errors.ResourceExhausted):
        t.acquire("b2", 1, 0, 1, B)
    t.acquire("p1", 1, 0, 1, P)
    t.acquire("p2", 1, 0, 1, P)  # peers are not capped


@pytest.mark.parametrize("extra,ok", [
    ([], False), (["--insecure"], True), (["--cluster-keys", "KEYS"], True),
])
def test_a_worker_beyond_loopback_needs_a_credential_or_insecure(tmp_path, extra, ok):
    keys = tmp_path / "keys"
    keys.write_text("workers 0123456789abcdef0123 peer\n")
    extra = [str(keys) if a == "KEYS" else a for a in extra]
    # a model that does not exist: the security check comes first, so a refusal names it;
    # past the check the worker fails on the model instead
    r = subprocess.run([sys.executable, "-m", "dgr.worker", "--model", str(tmp_path / "no.gguf"),
                        "--listen", "0.0.0.0:0", *extra], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert ("--insecure" in r.stderr and "reachable beyond this machine" in r.stderr) != ok
