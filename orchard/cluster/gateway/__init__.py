"""The OpenAI-compatible HTTP front and the backends behind it.

    app.py            `create_app`: routes, OpenAPI, middleware
    state.py          `Gateway` and `GatewayConfig`: what the routes share, admission to the queue
    protocol.py       the wire format (pydantic models of OpenAI's requests and responses)
    serving.py        from a validated request to engine jobs, and from outputs back to OpenAI
    jobs.py           one request's jobs on the backend: timeouts, client disconnects, metrics
    chat_template.py  chat messages to prompt token ids
    errors.py         typed errors and the one place they become HTTP statuses
    guard.py          what is refused before a body is read (size, API key)
    backend.py        the `Backend` protocol and `LocalBackend` (one engine in process)
    ray_backend.py    `RayBackend`: route with the coordinator, stream from node actors
    served_models.py  the models a Ray-backed gateway serves, as local state refreshed behind requests
    resume.py         continuing a stream on another node when its node is lost
    block_pull.py     carrying out a route's migration: the target pulls blocks from the source
    metrics.py        Prometheus metrics measured at the gateway (`orchard_*` and `vllm:*`)
    cluster_metrics.py  the nodes' figures as Prometheus families, from one cluster snapshot
    dashboard.py      /dashboard and the JSON it polls (files in static/)
"""
