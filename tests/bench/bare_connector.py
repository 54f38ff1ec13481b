"""The least a KV connector can do for a remote prefill in vLLM's scheduler: vLLM's own floor.

``push_bench``'s scheduler part subtracts it: a request whose KV loads asynchronously costs
vLLM work of its own (admission against every load in flight, the WAITING_FOR_REMOTE_KVS
state, promotion when the KV is in) whatever the connector does. This connector asks for
every prompt token a request's params mark as remote, and names the allocated requests in its
metadata so the bench can report their KV in; it writes nothing anywhere. Only its scheduler
side is ever called (the bench has no workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass(frozen=True, slots=True)
class Recv:
    req_id: str


@dataclass
class BareMetadata(KVConnectorMetadata):
    recvs: list[Recv] = field(default_factory=list)


class BareConnector(KVConnectorBase_V1):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._claimed: set[str] = set()
        self._new: list[Recv] = []

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or request.request_id in self._claimed:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0 and request.request_id not in self._claimed:
            self._claimed.add(request.request_id)
            self._new.append(Recv(request.request_id))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._new = BareMetadata(self._new), []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._claimed.discard(request.request_id)
        return False, None

    # worker side: never called by the bench
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError
