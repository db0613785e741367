"""A real S3-compatible server for tests: moto's server mode on 127.0.0.1 (a free port), in a
thread of this process, with one bucket. Clients reach it over HTTP like any S3 endpoint:
tensorstore's s3 driver (through `S3Options(endpoint=...)`) and boto3 (to damage objects).

moto accepts any signed request; tensorstore signs with the keys `LocalS3.env` holds, from the
environment (`S3Options(credentials="environment")`: the `s3_server` fixture sets them for its
module, subprocesses get them in theirs). tensorstore addresses a custom endpoint
path-style (`endpoint/bucket/key`), which moto serves; its conditional writes (If-None-Match,
If-Match), which the guidance store's commits rely on, moto honours too.
"""

from __future__ import annotations

import logging
import socket

import boto3
from moto.server import ThreadedMotoServer

BUCKET = "trace-jax-guidance"
REGION = "us-east-1"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class LocalS3:
    """A running server: `endpoint` ("http://127.0.0.1:<port>"), `bucket`, a boto3 `client`."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # The server logs every request at INFO through werkzeug; only failures matter here.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.bucket = BUCKET
        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
        )
        self.client.create_bucket(Bucket=BUCKET)

    @property
    def env(self) -> dict[str, str]:
        """The environment a client process needs (the keys)."""
        return dict(KEYS)

    def keys(self, prefix: str) -> list[str]:
        """Every object key under `prefix`, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def stop(self) -> None:
        self._server.stop()
