# Sourced by the study scripts that decode in lanes, one per core: wait for every lane, and fail if
# any lane failed (a bare `wait` returns 0 whatever the lanes did).
wait_lanes() {
  local status=0 pid
  for pid in "$@"; do wait "$pid" || status=$?; done
  return "$status"
}
