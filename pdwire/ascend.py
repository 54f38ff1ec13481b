"""vllm-ascend's layerwise handoff (``MooncakeLayerwiseConnector``), as unchanged engines speak it.

Read from vllm-project/vllm-ascend (HEAD 182b75e, 2026-08):
``vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_layerwise_connector.py`` and
``examples/disaggregated_prefill_v1/load_balance_proxy_layerwise_server_example.py``.

proxy → D   ``ascend_decode_leg``: ``{"do_remote_decode": false, "do_remote_prefill": true,
            "metaserver": URL}`` with ``X-Request-Id: T``; URL carries ``?rid=T&cap=C``
            where a metaserver needs credentials (``capability``); vLLM's OpenAI server names D's
            requests ``cmpl-T-<i>`` (one per prompt of a completions batch) or ``chatcmpl-T``
            (``ascend_request_ids``)
D → URL     ``AscendBinding``: the dict ``MooncakeLayerwiseConnectorScheduler.
            update_state_after_alloc`` POSTs (``_access_metaserver``: no auth, status ignored,
            3 tries on transport errors); the metaserver validates it with this model
proxy → P   ``ascend_prefill_params``: D's dict as P's ``kv_transfer_params`` (P's scheduler
            reads ``remote_cached_tokens``, its worker ``remote_*``); for a batch, child 0's dict
            plus ``batch_kv_transfer_params`` {child id: dict}, as the example proxy sends it.
            P gets the same ``X-Request-Id`` so its request ids equal D's: P signals D with its
            own external id (``send_done_send_signal``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from pdwire.fields import MAX_BLOCKS_PER_GROUP, MAX_KV_GROUPS, MAX_TP_SIZE, BlockId, Host, Port
from pdwire.ids import ID_PATTERN

BATCH_KEY = "batch_kv_transfer_params"  # vllm_ascend ... sfa_pd_rd2h/protocol.py
MAX_BATCH = 256  # prompts of one completions request (the proxy refuses more, in every flow)
COMPAT_PATH = "/v1/ascend/metaserver"  # the metaserver's endpoint D posts to
# the record fields the metaserver adds around D's dict (metaserver.store.base.StoredBinding)
_RECORD_FIELDS = ("transfer_id", "state", "created_at", "updated_at", "events")

Size = Annotated[int, Field(ge=1, le=MAX_TP_SIZE)]
BlockSize = Annotated[int, Field(ge=1, le=4096)]


class AscendBinding(BaseModel):
    """The body D's scheduler connector POSTs at scheduling time (``update_state_after_alloc``).

    ``remote_block_ids`` is a list per KV cache group, or ``[]`` when D holds the whole prompt
    (``num_external_tokens == 0``); ``remote_block_size`` is one size per group. Unknown fields
    are refused: P must get nothing the deployment did not vet."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=0)] = Field(
        default_factory=list, description="always [] (the connector sends no tokens)"
    )
    request_id: Annotated[str, Field(pattern=ID_PATTERN)] = Field(
        description="D's external request id: cmpl-<X-Request-Id>-<i> or chatcmpl-<X-Request-Id>"
    )
    do_remote_prefill: Literal[False] = False
    do_remote_decode: Literal[True] = True
    remote_block_ids: Annotated[
        list[Annotated[list[BlockId], Field(max_length=MAX_BLOCKS_PER_GROUP)]],
        Field(max_length=MAX_KV_GROUPS),
    ]
    remote_block_size: Annotated[list[BlockSize], Field(min_length=1, max_length=MAX_KV_GROUPS)]
    remote_engine_id: Annotated[str, Field(min_length=1, max_length=256)]
    remote_host: Host
    remote_port: Port
    remote_tp_size: Size
    remote_pcp_size: Size = 1
    remote_dcp_size: Size = 1
    remote_cached_tokens: Annotated[int, Field(ge=0, le=2**24)] = 0


def capability(key: bytes, x_request_id: str) -> str:
    """The right to post the blocks of one request (``X-Request-Id``) to the metaserver: an
    HMAC-SHA256 over it keyed with a proxy's (or the single) metaserver token. D's connector
    cannot send a header; the URL carries this instead of a token that could do more."""
    mac = hmac.new(key, b"pdgate-ascend-binding\n" + x_request_id.encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


def callback_urls(base_url: str, token: str | None) -> Callable[[str], str]:
    """``X-Request-Id`` → the URL D posts that request's blocks to."""
    if token is None:
        return lambda x_request_id: base_url
    key = token.encode()
    sep = "&" if "?" in base_url else "?"
    return lambda rid: f"{base_url}{sep}rid={rid}&cap={capability(key, rid)}"


def x_request_id_of(request_id: str) -> str | None:
    """The ``X-Request-Id`` a D request id was made from (``ascend_request_ids``' inverse)."""
    if request_id.startswith("chatcmpl-"):
        return request_id[9:] or None
    if request_id.startswith("cmpl-"):
        rid, _, index = request_id[5:].rpartition("-")
        return rid if rid and index.isdigit() else None
    return None


def ascend_decode_leg(metaserver_url: str) -> dict[str, Any]:
    """D's ``kv_transfer_params``: receive the prompt's KV, POST your blocks to this URL."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": metaserver_url}


def prompt_count(prompt: object) -> int:
    """How many engine requests vLLM makes of a completions ``prompt``: a list of strings or of
    token lists is a batch; a string or one token list is one prompt."""
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return 1


def ascend_id_prefixes(x_request_prefix: str) -> tuple[str, str]:
    """What D's request ids start with when every ``X-Request-Id`` starts with
    ``x_request_prefix`` (a binding feed asks for them)."""
    return f"cmpl-{x_request_prefix}", f"chatcmpl-{x_request_prefix}"


def ascend_request_ids(x_request_id: str, chat: bool, prompt: object = None) -> list[str]:
    """D's (and P's) external request ids for ``X-Request-Id: x_request_id``."""
    if chat:
        return [f"chatcmpl-{x_request_id}"]
    return [f"cmpl-{x_request_id}-{i}" for i in range(prompt_count(prompt))]


_record = msgspec.json.Decoder(dict[str, Any])


def binding_of_record(record: bytes) -> dict[str, Any]:
    """D's dict out of the metaserver's binding record (``GET /v1/bindings/{id}``)."""
    params = _record.decode(record)
    for key in _RECORD_FIELDS:
        params.pop(key, None)
    return params


def ascend_prefill_params(ids: Sequence[str], bindings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """P's ``kv_transfer_params`` from D's dicts, in the order of ``ids``."""
    if len(bindings) == 1:
        return bindings[0]
    return {**bindings[0], BATCH_KEY: dict(zip(ids, bindings, strict=True))}
