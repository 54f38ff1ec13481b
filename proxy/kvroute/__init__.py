"""Routing on the engines' real prefix caches (``--prefill-policy kv`` / ``--decode-policy kv``).

``tokens``: the request's token ids as the engine will see them (the model's tokenizer and chat
template, loaded once); ``lookup``: their block keys (``pdwire.block_hash``) matched against the
metaserver's KV-event index, once per request, before P and D are chosen.
"""
