"""A local two-node Ray cluster on the loopback for the Ray tests, in its own process (Ray reads its settings when it is
imported): `python -m tests.ray_cluster` prints the cluster's address, then holds it until its standard input closes
(or SIGTERM), and shuts every node down. Each node has one CPU, so that two replicas land one a node. Run it with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray then keeps every node, and its traffic, on 127.0.0.1."""
from __future__ import annotations

import signal
import sys

from ray.cluster_utils import Cluster


def main() -> None:
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  node = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
  cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
  try:
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    sys.stdin.read()
  finally:
    cluster.shutdown()


if __name__ == "__main__":
  main()
