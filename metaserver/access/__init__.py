"""Who may call what on the metaserver.

Three modes, from the settings:

- **open** (no ``--token``, no ``--credentials-file``): every call is allowed. One machine,
  development: ``pd-metaserver`` refuses it on a non-loopback address unless
  ``--insecure-open``.
- **single token** (``--token``): that one bearer token may do everything. For small setups whose
  parts are all trusted alike: every engine pod then holds a token that can drain the fleet.
- **roles** (``--credentials-file``): each bearer token in the file has one role:

  ========  ================================================================================
  admin     everything
  proxy     reads; binding marks (no events); drain and undrain
  engine    reads; register, heartbeat, drain and deregister the instances it is bound to
            (``instance``: one id, or a prefix ending in ``*`` for a pool whose ids are made
            at start, such as pod names; at most ``max_instances`` live, on ``hosts``); write
            bindings that name such an instance as their decode; post the events that are
            such an instance's steps; ``engine_role`` limits what it registers
  reader    reads (the timeline page, dashboards)
  ========  ================================================================================

Reads need a credential too unless ``--open-reads`` (open mode aside). A call without a known
token is 401; a known token whose role does not allow the call is 403, naming the role.

Tokens are found by their SHA-256 (a dict lookup, not a comparison that leaks their bytes by
timing). On Kubernetes an engine pod may instead present its own projected ServiceAccount token
(``kubernetes:`` entries, ``access.kube``): it then acts as that pod alone. The proxy's and
admin's tokens also key the per-request capabilities that vllm-ascend D engines present
(``pdwire.ascend.capability``), so no deployment token travels in a request.
"""

from metaserver.access.credentials import CredentialEntry
from metaserver.access.gate import Access
from metaserver.access.principal import ANONYMOUS, READER, Principal, Role

__all__ = ["ANONYMOUS", "READER", "Access", "CredentialEntry", "Principal", "Role"]
