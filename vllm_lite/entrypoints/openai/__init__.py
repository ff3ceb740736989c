"""The OpenAI-compatible server: ``api_server`` (the app and ``serve``), ``protocol``
(request / response bodies), ``serving_*`` (one endpoint family each), ``sse``."""
