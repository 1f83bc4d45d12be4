"""A chain's certificate authority and its members' certificates (for :mod:`skippy.net.tls`).

Strategy: one self-signed CA per chain (``ca.pem``, its key ``ca.key``), and one certificate per
stage and per driver signed by it (``NAME.pem`` / ``NAME.key``), each usable for both ends of a
link (server and client authentication: a stage listens and dials).  Keys are ECDSA P-256; key
files are written with mode 0600.  An existing CA in the directory is reused, so more members can
be added later; an existing member's files are replaced.  Made with the ``cryptography`` library
(the ``skippy-llm[tls]`` extra), imported only here.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["make_chain_certificates"]

_DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def _crypto() -> Any:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("making certificates needs the cryptography library: pip install 'skippy-llm[tls]'") from exc
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    descriptor = os.open(path, flags, 0o600 if secret else 0o644)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    if secret:
        os.chmod(path, 0o600)


def make_chain_certificates(directory: Path, names: Sequence[str], *, hosts: Sequence[str] = (),
                            days: int = 365, chain_name: str = "skippy chain") -> list[Path]:
    """Write (or reuse) the chain CA in ``directory`` and a certificate for each of ``names``.

    Args:
        names: members, e.g. ``stage-0``, ``stage-1``, ``driver`` (file names: letters, digits, ``-_.``).
        hosts: extra DNS names / IP addresses put in every member's certificate (informational:
            peers are authenticated by the CA, not by host name).
        days: validity of the certificates made now.

    Returns:
        The files written.

    Raises:
        ValueError: a bad name or day count.
    """
    x509, hashes, serialization, ec, usage, oid = _crypto()
    if days < 1:
        raise ValueError(f"certificates must be valid for at least one day (got {days})")
    for name in names:
        if not name or not all(ch.isalnum() or ch in "-_." for ch in name) or name == "ca":
            raise ValueError(f"certificate name {name!r} must be letters, digits, '-', '_' or '.', and not 'ca'")
    now = datetime.datetime.now(datetime.timezone.utc)
    written: list[Path] = []
    ca_cert_path, ca_key_path = directory / "ca.pem", directory / "ca.key"
    if ca_cert_path.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(oid.COMMON_NAME, f"{chain_name} CA")])
        ca_cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(ca_key_path, ca_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), secret=True)
        _write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), secret=False)
        written += [ca_cert_path, ca_key_path]
    alternative: list[Any] = []
    for host in (*_DEFAULT_HOSTS, *hosts):
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alternative.append(x509.DNSName(host))
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(oid.COMMON_NAME, name),
                                     x509.NameAttribute(oid.ORGANIZATION_NAME, chain_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage.SERVER_AUTH, usage.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        key_path, cert_path = directory / f"{name}.key", directory / f"{name}.pem"
        _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), secret=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), secret=False)
        written += [cert_path, key_path]
    return written
