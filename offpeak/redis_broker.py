"""kombu's Redis transport, with a broker that went away always reported as a connection error.

When the broker goes away under a running Celery worker, its consumer collects the broken
connection (kombu sets the transport's ``client`` to None) and then closes it. A channel still
holding unacknowledged deliveries (a task in flight, a ``-P threads`` worker's acks) then tries
to put them back, and kombu's Redis channel reads the broker's host from that ``client``:
``AttributeError: 'NoneType' object has no attribute 'hostname'`` (kombu 5.x,
``Channel._connparams``; the race of celery/kombu#582). That is none of the transport's
connection errors, so Celery calls it unrecoverable and the worker stops.

This transport raises ``redis.exceptions.ConnectionError`` at that moment instead: one of
the errors kombu and Celery already expect of a lost broker. The put-back is skipped (the
broker cannot be reached; Offpeak's sweep sends again what a lost broker dropped) and the
consumer reconnects as it does after any other connection loss.

Selected for ``redis://`` broker URLs by ``offpeak.celery_app.make_celery``
(``broker_transport = "offpeak.redis_broker:Transport"``). ``rediss://`` keeps kombu's own
transport: naming a transport explicitly drops kombu's TLS defaults for that scheme.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError


class Channel(kombu_redis.Channel):
    """kombu's Redis channel; a channel whose connection was collected raises
    ``redis.exceptions.ConnectionError`` when it needs the broker again."""

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None or self.connection.client is None:
            raise RedisConnectionError("the connection to the broker was closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
        return params


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with ``Channel`` above."""

    Channel = Channel
