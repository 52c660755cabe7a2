"""Shadow answers: a sampled share of routed answers is also asked of the upstream directly, in the
background, to measure what routing costs in quality (agreement with upstream-only) and saves in
money, pooled over replicas in the Store; a controller per alias can hold a quality target by
moving one routing knob. See docs/routing.md#shadow-answers.

Modules: config (the settings branch), figures (counters -> agreement, Wilson interval, costs),
controller (the knob's moves, pure), cases (what one finished answer hands over), service (the
queue, the sampling, the store writes), lanes (one alias's state, carried through a reload),
spending (the operator's budget and a tenant's share of it), learning (routing.learn: examples, the fit and
promotion of a learned answer check), report (GET /admin/quality's body). The package
sits between tenancy and the runtime: the runtime builds the service; nothing here imports the
runtime, decoding or admission (cases reads a finished request by duck typing).
"""
