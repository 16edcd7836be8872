"""Chapter 16 — beyond one server: engine replicas on Ray Serve behind chapter 08's HTTP app.

A local fleet (Ray started here, no --ray-address) listens on loopback only. On Linux Ray gives each node the
machine's address and its GCS, raylet and agents listen on every interface (even a `127.0.0.1` given to
`ray.init` is rewritten to that address), unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is "0": then a node started
in this process is a one-machine Ray on 127.0.0.1, as on a laptop. Ray reads it once, when it is imported, so it
is set here, before any module of this package imports Ray, unless the environment already says otherwise (a
driver that joins a cluster, --ray-address, takes the address of the node it joins either way).
deploy.start_ray checks the outcome.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
