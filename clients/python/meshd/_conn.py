"""How a Session reaches its server: TLS, mTLS and the bearer token (docs/security.md).

    creds = resolve(addr, token=..., root_certs=..., ...)   # arguments, then MESHD_* env
    channel = open_channel(addr, creds, options)
    metadata = creds.auth_metadata()                          # sent on every call

Arguments win over the environment: token over MESHD_TOKEN, root_certs over
MESHD_TLS_CA, cert_chain over MESHD_TLS_CERT, private_key over MESHD_TLS_KEY,
server_name over MESHD_TLS_SERVER_NAME; MESHD_TLS=1 turns TLS on with the system roots.
Any certificate implies TLS. A token is never sent in plaintext to an address that is
not loopback unless insecure=True. The token is kept out of reprs and messages."""

import ipaddress
import os
from typing import Union

import grpc

ENV_TOKEN = "MESHD_TOKEN"
ENV_TLS = "MESHD_TLS"
ENV_CA = "MESHD_TLS_CA"
ENV_CERT = "MESHD_TLS_CERT"
ENV_KEY = "MESHD_TLS_KEY"
ENV_SERVER_NAME = "MESHD_TLS_SERVER_NAME"

MAX_TOKEN = 4096  # bytes; far above any real token, far below gRPC's header limit


# PEM bytes, a str holding PEM, or the path of a PEM file (connect's root_certs, ...).
Pem = Union[bytes, str, os.PathLike[str], None]


def _env(env, name):
    v = env.get(name)
    return v if v else None  # empty counts as unset, as for every MESHD_* variable


def _check_token(token, source):
    """Visible ASCII without spaces (what a tokens file line can hold); the message
    never shows the token."""
    if not isinstance(token, str):
        raise TypeError(f"meshd: {source}: the token must be a str, got {type(token).__name__}")
    if len(token) > MAX_TOKEN:
        raise ValueError(f"meshd: {source}: the token is {len(token)} characters, more than "
                         f"{MAX_TOKEN}")
    bad = next((i for i, ch in enumerate(token) if not "!" <= ch <= "~"), None)
    if bad is not None:
        raise ValueError(f"meshd: {source}: the token has a character that is not visible "
                         f"ASCII at position {bad} (spaces, control characters and non-ASCII "
                         f"are not allowed)")


def _pem(value, what):
    """PEM bytes from bytes, a str holding PEM, or a path (str or os.PathLike). `what`
    names the argument or variable in errors, which never quote the contents."""
    if value is None:
        return None
    origin = what
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, str) and "-----BEGIN" in value:
        data = value.encode()
    elif isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(f"meshd: {what}: cannot read {path}: {e.strerror}") from None
        origin = f"{what} ({path})"
    else:
        raise TypeError(f"meshd: {what}: expected PEM bytes or a file path, got "
                        f"{type(value).__name__}")
    if b"-----BEGIN" not in data:
        raise ValueError(f"meshd: {origin}: not PEM (no '-----BEGIN' line)")
    return data


def _target_hosts(addr):
    """The hosts a gRPC target names, or [] for a local socket ("unix:...")."""
    a = addr.strip()
    if a.startswith(("unix:", "unix-abstract:")):
        return []
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if a.startswith(scheme):
            a = a[len(scheme):]
            if a.startswith("//"):  # dns://authority/host:port
                a = a[2:].split("/", 1)[-1]
            break
    hosts = []
    for part in a.split(","):  # ipv4:a:1,b:2
        part = part.strip()
        if part.startswith("["):
            hosts.append(part[1:part.find("]")] if "]" in part else part[1:])
        elif part.count(":") == 1:
            hosts.append(part.split(":", 1)[0])
        else:
            hosts.append(part)  # no port, or a bare IPv6 address
    return hosts


def is_loopback(addr):
    """True if every host `addr` names is loopback (localhost, 127.0.0.0/8, ::1) or it
    is a local socket."""
    for host in _target_hosts(addr):
        if host.lower() == "localhost":
            continue
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False  # a name: it may resolve anywhere
        mapped = getattr(ip, "ipv4_mapped", None)
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            return False
    return True


class Credentials:
    """What a Session connects with; made by resolve(). The token stays private."""

    __slots__ = ("tls", "root_certs", "cert_chain", "private_key", "server_name", "_token")

    def __init__(self, tls, root_certs, cert_chain, private_key, server_name, token):
        self.tls, self.root_certs, self.cert_chain = tls, root_certs, cert_chain
        self.private_key, self.server_name, self._token = private_key, server_name, token

    @property
    def has_token(self):
        return self._token is not None

    def auth_metadata(self):
        """(("authorization", "Bearer ..."),) or () without a token."""
        return (("authorization", "Bearer " + self._token),) if self._token else ()

    def __repr__(self):
        return (f"Credentials(tls={self.tls}, root_certs={'set' if self.root_certs else None}, "
                f"client_cert={'set' if self.cert_chain else None}, "
                f"server_name={self.server_name!r}, token={'set' if self._token else None})")

    def __reduce__(self):
        raise TypeError("meshd: credentials are not picklable (they hold a token and a key)")


def resolve(addr, token=None, tls=False, root_certs=None, cert_chain=None, private_key=None,
            server_name=None, insecure=False, env=None):
    """Credentials from the arguments, then the MESHD_* environment (module doc).
    Raises ValueError/TypeError naming the argument (or variable) at fault."""
    env = os.environ if env is None else env
    if token is None:
        token = _env(env, ENV_TOKEN)
        if token is not None:
            _check_token(token, "$" + ENV_TOKEN)
    elif token == "":
        token = None  # explicitly none: MESHD_TOKEN is not read
    else:
        _check_token(token, "token")
    picks = []
    for value, what, name in ((root_certs, "root_certs", ENV_CA), (cert_chain, "cert_chain", ENV_CERT),
                              (private_key, "private_key", ENV_KEY)):
        if value is None and _env(env, name) is not None:
            value, what = _env(env, name), "$" + name
        picks.append(_pem(value, what))
    roots, chain, key = picks
    if (chain is None) != (key is None):
        have, miss = ("cert_chain", "private_key") if chain is not None else ("private_key", "cert_chain")
        raise ValueError(f"meshd: {have} was given without {miss} ({ENV_CERT}/{ENV_KEY}): a client "
                         f"certificate needs both")
    if server_name is None:
        server_name = _env(env, ENV_SERVER_NAME)
    env_tls = (_env(env, ENV_TLS) or "").lower()
    if env_tls not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ValueError(f"meshd: ${ENV_TLS}: expected 1/0/true/false/yes/no, got {env_tls!r}")
    use_tls = bool(tls) or env_tls in ("1", "true", "yes") or any(
        v is not None for v in (roots, chain, server_name))
    if token is not None and not use_tls and not insecure and not is_loopback(addr):
        raise ValueError(f"meshd: refusing to send a token in plaintext to {addr}, which is not a "
                         f"loopback address: connect with TLS (tls=True or root_certs=...), or "
                         f"pass insecure=True to send it anyway")
    return Credentials(use_tls, roots, chain, key, server_name, token)


def open_channel(addr, creds, options):
    """A grpc channel to addr: TLS per creds, else plaintext."""
    if not creds.tls:
        return grpc.insecure_channel(addr, options=options)
    opts = list(options)
    if creds.server_name:
        opts.append(("grpc.ssl_target_name_override", creds.server_name))
    ssl = grpc.ssl_channel_credentials(root_certificates=creds.root_certs,
                                       private_key=creds.private_key,
                                       certificate_chain=creds.cert_chain)
    return grpc.secure_channel(addr, ssl, options=opts)
