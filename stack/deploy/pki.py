"""A private CA and the certificates it signs: the NATS server's, one client certificate per bus
user, and the API's HTTPS certificate.

The CA exists only for this deployment, so nobody outside it can mint a certificate the bus
accepts; its key never leaves the init volume's private folder. ECDSA P-256 keys: quick to make
on a small host and accepted by nats-server, Python's ssl and every browser.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 825  # the longest lifetime browsers accept for a server certificate


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, both PEM."""

    cert: bytes
    key: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "greyhound"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def new_ca(common_name: str = "greyhound deployment CA") -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(_name(common_name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _alt_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(ca: Issued, common_name: str, *, server_names: Iterable[str] = (),
          client: bool = False) -> Issued:
    """A leaf signed by ``ca``: a server certificate for ``server_names`` (DNS names or IP
    addresses), a client certificate, or both."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    names = list(dict.fromkeys(server_names))
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if names else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    if not usages:
        raise ValueError("a certificate for neither a server nor a client")
    b = (x509.CertificateBuilder().subject_name(_name(common_name))
         .issuer_name(ca_cert.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                        critical=False))
    if names:
        b = b.add_extension(x509.SubjectAlternativeName([_alt_name(n) for n in names]),
                            critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def server_names(cert_pem: bytes) -> list[str]:
    """The DNS names and addresses a certificate is valid for (empty: a client certificate)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*alt.get_values_for_type(x509.DNSName),
            *(str(a) for a in alt.get_values_for_type(x509.IPAddress))]


def signed_by(cert_pem: bytes, ca: Issued) -> bool:
    """Whether ``cert_pem`` was issued by this CA (a CA that was replaced voids its leaves)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
