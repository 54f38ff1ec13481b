"""Drains: how an instance is taken out of selection on purpose and put back.

A drain is recorded where every proxy replica looks: the ``draining`` flag of the instance's
registration in the metaserver. ``DrainWatch`` reads the registry every discovery interval
(whatever the discovery source: instances are matched by URL) and hands it to the registry;
``DrainControl`` is the admin call: it sets the flag through the metaserver and applies it to
this proxy at once. An instance the registry does not know (a static ``--prefill`` /
``--decode`` URL of an engine without the connector) can only be drained on this proxy; its id
is then its ``host:port``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from pdwire.client import (
    AsyncMetaserverClient,
    MetaserverHTTPError,
    MetaserverUnavailable,
    NotFoundError,
    ServerError,
)
from pdwire.ids import valid_id
from proxy.errors import BadRequest, MetaserverDown, NotFound, UpstreamError
from proxy.instances.instance import Instance
from proxy.instances.registry import Registry

log = logging.getLogger("pdgate.proxy.drain")


class DrainWatch:
    def __init__(self, client: AsyncMetaserverClient, registry: Registry) -> None:
        self._client = client
        self._registry = registry

    async def poll(self) -> None:
        self._registry.apply_registry(await self._client.list_instances())

    async def run(self, interval_s: float) -> None:
        """Poll forever; a failed poll keeps the drains last seen (and is logged)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll()
            except Exception as exc:
                log.warning("registry poll for drains failed, keeping the last ones: %s", exc)


@dataclass(frozen=True, slots=True)
class DrainResult:
    id: str
    draining: bool
    scope: str  # "metaserver": every proxy replica; "proxy": this one only
    url: str | None
    instances: list[Instance] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "draining": self.draining,
            "scope": self.scope,
            "url": self.url,
            "instances": [i.describe() for i in self.instances],
        }


class DrainControl:
    def __init__(self, registry: Registry, client: AsyncMetaserverClient | None) -> None:
        self._registry = registry
        self._client = client

    async def set(self, instance_id: str, draining: bool) -> DrainResult:
        if not valid_id(instance_id):
            raise BadRequest(f"{instance_id!r} is not an instance id")
        if self._client is not None:
            try:
                rec = await self._client.set_draining(instance_id, draining)
            except NotFoundError:
                pass  # not registered: maybe one of this proxy's own instances
            except (MetaserverUnavailable, ServerError) as exc:
                raise MetaserverDown(f"the metaserver did not answer: {exc}") from exc
            except MetaserverHTTPError as exc:
                raise UpstreamError(f"the metaserver refused the drain: {exc}") from exc
            else:
                self._registry.drain_remote(rec)
                url = rec.url.rstrip("/")
                mine = [i for i in self._registry.instances() if i.url == url]
                log.info("instance %s (%s) %s in the metaserver", instance_id, url, _verb(draining))
                return DrainResult(instance_id, draining, "metaserver", url, mine)
        mine = self._registry.find(instance_id)
        if not mine:
            why = (
                "is neither registered in the metaserver nor one of this proxy's instances"
                if self._client is not None
                else "is not one of this proxy's instances"
            )
            raise NotFound(f"instance {instance_id} {why}")
        self._registry.drain_local({i.url for i in mine}, draining)
        log.info("instance %s %s on this proxy only", instance_id, _verb(draining))
        return DrainResult(instance_id, draining, "proxy", mine[0].url, mine)


def _verb(draining: bool) -> str:
    return "drained" if draining else "undrained"
