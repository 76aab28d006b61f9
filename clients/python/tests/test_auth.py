"""TLS, mTLS and bearer tokens (meshd/_conn.py): the options and the plaintext-token rule
without a server, then against a real meshd with --tls-cert/--tls-key and --auth-tokens
(one server for this module) and one that also wants client certificates (mTLS)."""

import os
import pickle
import subprocess

import pytest

import meshd
from meshd import _conn
from conftest import REPO, _TMP

SECRET = "s3cret-TOKEN-a1b2c3"


@pytest.fixture(scope="module")
def pki():
    """make_certs.sh's folder: ca.pem, server.pem/key, client.pem/key, rogue-ca.pem ..."""
    d = os.path.join(_TMP, "pki")
    subprocess.run(["bash", os.path.join(REPO, "tests", "support", "make_certs.sh"), d],
                   check=True, stdout=subprocess.DEVNULL, timeout=60)
    return d


@pytest.fixture
def no_env(monkeypatch):
    for k in ("MESHD_TOKEN", "MESHD_TLS", "MESHD_TLS_CA", "MESHD_TLS_CERT", "MESHD_TLS_KEY",
              "MESHD_TLS_SERVER_NAME"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


# ------------------------------------------------------------------ no server

@pytest.mark.parametrize("addr", [
    "10.0.0.5:50051", "meshd.example:50051", "dns:///meshd.example:50051",
    "dns://8.8.8.8/localhost.example:1", "[2001:db8::1]:50051", "ipv4:127.0.0.1:1,10.0.0.1:1",
    "127.0.0.1.example.com:1", "[::ffff:10.0.0.1]:1", "2001:db8::1"])
def test_token_is_not_sent_in_plaintext_to_a_remote_address(no_env, addr):
    with pytest.raises(ValueError) as e:
        meshd.connect(addr, token=SECRET)
    msg = str(e.value)
    assert "plaintext" in msg and addr in msg and "insecure=True" in msg, msg
    assert SECRET not in msg
    no_env.setenv("MESHD_TOKEN", SECRET)  # the same from the environment
    with pytest.raises(ValueError, match="plaintext"):
        meshd.connect(addr)


@pytest.mark.parametrize("addr", [
    "127.0.0.1:1", "localhost:1", "LOCALHOST:1", "[::1]:1", "dns:///localhost:1",
    "ipv4:127.0.0.2:1", "unix:/nonexistent.sock", "[::ffff:127.0.0.1]:1"])
def test_loopback_addresses(addr):
    assert _conn.is_loopback(addr)
    assert _conn.resolve(addr, token=SECRET, env={}).has_token


def test_tls_or_insecure_lifts_the_rule(no_env, pki):
    addr = "10.0.0.5:50051"
    assert _conn.resolve(addr, token=SECRET, tls=True, env={}).tls
    assert _conn.resolve(addr, token=SECRET, root_certs=os.path.join(pki, "ca.pem"), env={}).tls
    c = _conn.resolve(addr, token=SECRET, insecure=True, env={})
    assert not c.tls and c.auth_metadata() == (("authorization", "Bearer " + SECRET),)
    assert _conn.resolve(addr, env={}).auth_metadata() == ()  # no token: nothing to protect
    assert _conn.resolve(addr, token="", env={"MESHD_TOKEN": SECRET}).auth_metadata() == ()
    assert _conn.resolve(addr, token=SECRET, env={"MESHD_TLS": "1"}).tls


@pytest.mark.parametrize("bad", [SECRET + " x", SECRET + "\n", "café" + SECRET, "\t" + SECRET,
                                 "a" * 4097])
def test_bad_tokens_are_refused_without_showing_them(bad):
    with pytest.raises(ValueError) as e:
        _conn.resolve("127.0.0.1:1", token=bad, env={})
    assert str(e.value).startswith("meshd: token: "), e.value
    assert SECRET not in str(e.value) and "a" * 100 not in str(e.value)
    with pytest.raises(ValueError, match=r"^meshd: \$MESHD_TOKEN: "):
        _conn.resolve("127.0.0.1:1", env={"MESHD_TOKEN": bad})
    with pytest.raises(TypeError, match="token must be a str"):
        _conn.resolve("127.0.0.1:1", token=b"bytes", env={})


def test_certificates_from_paths_bytes_and_environment(pki):
    ca, cert, key = (os.path.join(pki, f) for f in ("ca.pem", "client.pem", "client.key"))
    with open(ca, "rb") as f:
        ca_pem = f.read()
    c = _conn.resolve("h:1", root_certs=ca, cert_chain=cert, private_key=key, env={})
    assert c.tls and c.root_certs == ca_pem and b"PRIVATE KEY" in c.private_key
    assert _conn.resolve("h:1", root_certs=ca_pem, env={}).root_certs == ca_pem
    assert _conn.resolve("h:1", root_certs=ca_pem.decode(), env={}).root_certs == ca_pem
    env = {"MESHD_TLS_CA": ca, "MESHD_TLS_CERT": cert, "MESHD_TLS_KEY": key,
           "MESHD_TLS_SERVER_NAME": "meshd-cluster"}
    c = _conn.resolve("h:1", env=env)
    assert c.tls and c.root_certs == ca_pem and c.cert_chain and c.server_name == "meshd-cluster"
    assert _conn.resolve("h:1", root_certs=ca_pem, env={"MESHD_TLS_CA": "/nonexistent"}).root_certs


def test_bad_certificate_options_are_named(pki):
    key = os.path.join(pki, "client.key")
    with pytest.raises(ValueError, match=r"^meshd: root_certs: cannot read /nonexistent/ca.pem: "):
        _conn.resolve("h:1", root_certs="/nonexistent/ca.pem", env={})
    with pytest.raises(ValueError, match=r"^meshd: \$MESHD_TLS_CA: cannot read /nonexistent: "):
        _conn.resolve("h:1", env={"MESHD_TLS_CA": "/nonexistent"})
    with pytest.raises(ValueError, match=r"^meshd: root_certs: not PEM"):
        _conn.resolve("h:1", root_certs=b"garbage", env={})
    with pytest.raises(ValueError, match="cert_chain was given without private_key"):
        _conn.resolve("h:1", cert_chain=os.path.join(pki, "client.pem"), env={})
    with pytest.raises(ValueError, match="private_key was given without cert_chain"):
        _conn.resolve("h:1", private_key=key, env={})
    with pytest.raises(TypeError, match="root_certs: expected PEM bytes or a file path"):
        _conn.resolve("h:1", root_certs=42, env={})
    with pytest.raises(ValueError, match=r"\$MESHD_TLS: expected"):
        _conn.resolve("h:1", env={"MESHD_TLS": "maybe"})


def test_credentials_never_show_the_token_or_key(pki):
    c = _conn.resolve("h:1", token=SECRET, cert_chain=os.path.join(pki, "client.pem"),
                      private_key=os.path.join(pki, "client.key"), env={})
    assert SECRET not in repr(c) and "PRIVATE" not in repr(c), repr(c)
    assert "token=set" in repr(c)
    with pytest.raises(TypeError):
        pickle.dumps(c)
