"""The instance registry's HTTP edge (``routes``): vLLM servers register and heartbeat so that
bindings may name them, and are drained or deregistered. The records and the rules that keep
URLs and KV endpoints unique are the store's (``metaserver.store``)."""
