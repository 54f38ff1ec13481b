"""What operators and their tools read: ``routes`` (``/health``, ``/ready``, ``/metrics``,
``/v1/stats``) and ``page`` (the ``/ui/`` timeline page, whose files are ``metaserver/ui/``)."""
