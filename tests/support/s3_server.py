"""A real S3-compatible server on 127.0.0.1 for tests: moto's server (its werkzeug HTTP app,
``moto.server.ThreadedMotoServer``) in a thread of the test process, reached through
pyarrow's S3 client over HTTP with ``AWS_ENDPOINT_URL`` (no mocked client).

``stop()`` closes the listening socket (clients get refused connections, as from a store
that is down) and ``start()`` opens a new server on the same port. moto's objects live in the test
process, so they survive the restart, as a store's objects survive on its disks. Inside
``refusing_credentials()`` moto checks every request's key and knows none: each is answered
403, as a store answers wrong credentials.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.mlflow_server import free_port

HOST = "127.0.0.1"
# Any key does for moto; real stores take theirs from the environment the same way.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
               "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """moto's server on a free loopback port; ``env`` points S3 clients at it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        """Down: the listening socket closed, so connections are refused."""
        if self._server is not None:
            self._server.stop()
            self._server._server.server_close()  # stop() leaves the socket open: clients would hang
            self._server = None

    @contextmanager
    def refusing_credentials(self) -> Iterator[None]:
        """Every request answered 403 (InvalidAccessKeyId, or AccessDenied without a body)."""
        from moto import settings

        saved = settings.INITIAL_NO_AUTH_ACTION_COUNT
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # authenticate from the first request on
        try:
            yield
        finally:
            settings.INITIAL_NO_AUTH_ACTION_COUNT = saved

    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(endpoint_override=self.endpoint, allow_bucket_creation=True,
                                 access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                 secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region="us-east-1")

    def upload(self, local: Path, bucket: str, prefix: str) -> str:
        """Every file under ``local`` to ``s3://bucket/prefix/``; the URI."""
        filesystem = self.filesystem()
        filesystem.create_dir(bucket)
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            with filesystem.open_output_stream(f"{bucket}/{prefix}/{path.relative_to(local).as_posix()}") as out:
                out.write(path.read_bytes())
        return f"s3://{bucket}/{prefix}"
