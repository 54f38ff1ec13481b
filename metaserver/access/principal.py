"""Who made a call (``Principal``) and what its role lets it do; ``metaserver.access``'s docstring
has the table."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from metaserver.access.hosts import Hosts
from metaserver.errors import Forbidden
from pdwire.models import InstanceRole, InstanceSpec
from pdwire.origin import parse_origin


class Role(enum.StrEnum):
    ADMIN = "admin"
    PROXY = "proxy"
    ENGINE = "engine"
    READER = "reader"


@dataclass(frozen=True, slots=True)
class Principal:
    """Whoever made a call: its credential's name and role (engines: the ids it may act as,
    the hosts it may register, how many instances it may hold)."""

    name: str
    role: Role
    instance: str | None = None  # engines: an id, or a prefix ending in "*"
    engine_role: InstanceRole | None = None
    hosts: Hosts | None = None  # engines: where its URL and KV endpoint may point (None: any)
    max_instances: int = 0  # engines: live registrations it may hold (0: no cap)

    @property
    def owner(self) -> str:
        """The name its registrations are counted under ('' : not counted)."""
        return self.name if self.role is Role.ENGINE else ""

    def covers(self, instance_id: str) -> bool:
        if self.instance is None:
            return False
        if self.instance.endswith("*"):
            return instance_id.startswith(self.instance[:-1])
        return instance_id == self.instance

    def _refuse(self, what: str) -> Forbidden:
        return Forbidden(f"credential {self.name!r} (role {self.role.value}) may not {what}")

    def may_register(self, instance_id: str, spec: InstanceSpec) -> None:
        """PUT an instance (register or heartbeat): an id it covers, its role, hosts it may
        name."""
        self.may_manage(instance_id)
        if self.engine_role is not None and spec.role is not self.engine_role:
            raise self._refuse(f"register a {spec.role.value} instance")
        if self.hosts is None:
            return
        hosts = [parse_origin(spec.url).host]
        if spec.kv_endpoint is not None:
            hosts.append(spec.kv_endpoint.host)
        for host in hosts:
            if not self.hosts.allows(host):
                raise self._refuse(f"register an instance on host {host!r}")

    def may_manage(self, instance_id: str) -> None:
        """Deregister an instance (and what registering needs)."""
        if self.role is Role.ADMIN or (self.role is Role.ENGINE and self.covers(instance_id)):
            return
        raise self._refuse(f"act as instance {instance_id!r}")

    def may_drain(self, instance_id: str) -> None:
        if self.role is Role.PROXY:
            return
        self.may_manage(instance_id)

    def may_bind(self, decode_instance_id: str) -> None:
        """Write a binding naming ``decode_instance_id`` as the decode."""
        if self.role is Role.ADMIN or (
            self.role is Role.ENGINE and self.covers(decode_instance_id)
        ):
            return
        raise self._refuse(f"write a binding for decode instance {decode_instance_id!r}")

    def may_post_event(self, actor: str) -> None:
        """Post a binding event as ``actor``: an admin, or an engine as itself (the store then
        checks that the step is the actor's, ``store.rules.owner_problem``). The proxy posts
        marks, not events: it reports what it saw, it does not move a transfer."""
        if self.role is Role.ADMIN or (self.role is Role.ENGINE and self.covers(actor)):
            return
        raise self._refuse(f"post a binding event as {actor!r}")

    @property
    def engine(self) -> bool:
        return self.role is Role.ENGINE

    def may_mark(self) -> None:
        if self.role not in (Role.ADMIN, Role.PROXY):
            raise self._refuse("post marks")

    def may_match(self) -> None:
        """Ask the KV index what a prompt's blocks are cached where: a proxy's routing question
        (anyone else could learn which prompts others sent)."""
        if self.role not in (Role.ADMIN, Role.PROXY):
            raise self._refuse("ask the KV index")

    def may_share_load(self) -> None:
        """Report a proxy replica's load (and read the others')."""
        if self.role not in (Role.ADMIN, Role.PROXY):
            raise self._refuse("share proxy load")

    def may_administer(self, what: str) -> None:
        if self.role is not Role.ADMIN:
            raise self._refuse(what)


ANONYMOUS = Principal("anonymous", Role.ADMIN)  # open mode: nobody is asked
READER = Principal("anonymous reader", Role.READER)  # an unchecked read
