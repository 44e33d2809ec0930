#!/bin/sh
# A sense_only pack's command: it prints one trigger per line for `hcp-sense pipe`.
# The fourth line is malformed on purpose, the fifth names an undeclared ref, and the
# command exits 3, as a pack whose upstream failed after a while would.
echo '{"ref": "storm.warning", "trigger_id": "feed-1", "payload": {"area": "north"}}'
echo '{"ref": "storm.warning", "trigger_id": "feed-2", "payload": {"area": "south"}}'
echo '{"ref": "storm.warning", "trigger_id": "feed-1", "payload": {"area": "north"}}'
echo '{"ref": "storm.warning", "payload": '
echo '{"ref": "storm.hail", "payload": {"area": "east"}}'
echo '{"ref": "Storm Warning"}'
echo '{"ref": "storm.warning", "payload": {"area": "west"}}'
exit 3
