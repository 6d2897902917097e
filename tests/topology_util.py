"""Shared by the topology tests (test_topology*.py): the layout of their 4 ranks, 2 nodes x
2, and its Topology from a 2-D DeviceMesh. Not a test module: importing it collects nothing."""
from lbcomm.topology import Topology

N, G = 2, 2  # nodes, ranks per node


def mesh_topology(nodes, local):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (nodes, local), mesh_dim_names=("node", "local"))
    return Topology.from_mesh(mesh)
