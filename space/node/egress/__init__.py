"""The node's egress gateway: DNS with synthetic addresses, connection checks, audit.

``fakeip`` maps allowed names to addresses of 198.18.0.0/15, ``dns`` answers the
guest's queries with them, ``audit`` keeps each sandbox's egress decisions.
"""
