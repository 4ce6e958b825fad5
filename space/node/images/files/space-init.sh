#!/bin/sh
export PYTHONPATH=/usr/lib/space/python
exec /usr/bin/python3 -B -m space.guest.init "$@"
