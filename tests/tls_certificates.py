"""Test certificates made with openssl (NATS over TLS tests). A module of its own: `from conftest
import ...` is ambiguous once another folder has a conftest.py."""

import subprocess


def make_certificates(d) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1 it signed (openssl), written into directory `d`:
    (ca, cert, key) paths."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")  # quicker to make than RSA
    openssl("req", "-x509", *ec, "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=layercast-test-ca")
    openssl("req", *ec, "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "1", "-extfile", "san.cnf")
    return str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key")
