"""The node's HTTP API: the server a node runs for remote control planes (``server``)
and the client a control plane holds such a node by (``client.RemoteNode``).

The two share only the contract (space.node.api), so a control plane imports
``space.node.http.client`` without the server's dependencies.
"""
