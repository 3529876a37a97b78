"""Scale-out: the router's config (``haproxy.cfg``) and a launcher of workers behind it on one
machine (:mod:`agentkv.server.scaleout.local`, for tests and benchmarks). README "Scale out"."""
