# shellcheck shell=bash
# A Ray cluster over a SLURM allocation, for examples/slurm/train.sbatch (which sources this file):
#   ray_cluster_up     a Ray head on the first node and a worker on every other, each under its own `srun`;
#                      returns once every node has joined (a Python poll of the head, with a timeout), or fails at
#                      once naming the node whose srun ended
#   ray_watch PID      waits for PID (the driver); returns its status, or 1 at once when a node's srun ends first
#                      (the driver is stopped, then SIGKILLed after RAY_DRIVER_STOP_S)
#   ray_cluster_down   ends every node's srun (srun forwards SIGTERM to `ray start --block`, which stops the
#                      node's Ray processes), SIGKILL after RAY_STOP_TIMEOUT_S
#
# Settings (environment; the defaults below). Every port is fixed and below Linux's ephemeral range (32768-60999),
# so a port the kernel handed to another process cannot collide with Ray's:
#   RAY_PORT=6379                          the head's GCS (cluster.ray_address=<head>:RAY_PORT)
#   RAY_NODE_MANAGER_PORT=6380             raylet, every node
#   RAY_OBJECT_MANAGER_PORT=6381           object manager, every node
#   RAY_CLIENT_SERVER_PORT=6382            Ray client server, head
#   RAY_RUNTIME_ENV_AGENT_PORT=6383, RAY_DASHBOARD_AGENT_GRPC_PORT=6384, RAY_DASHBOARD_AGENT_LISTEN_PORT=6385,
#   RAY_METRICS_EXPORT_PORT=6386           per-node agents (the dashboard itself is off)
#   RAY_MIN_WORKER_PORT=10002, RAY_MAX_WORKER_PORT=10999   Ray's worker processes
#   RAY_JOIN_TIMEOUT_S=300                 how long the nodes may take to join
#   NET_IFNAME                             the network interface Ray's node addresses, NCCL (NCCL_SOCKET_IFNAME) and
#                                          gloo (GLOO_SOCKET_IFNAME) use; unset = each library's own choice
#   RAY_HEAD_IP                            the head's address; default: NET_IFNAME's, else `hostname --ip-address`
#                                          (127.0.1.1 on a stock Debian/Ubuntu /etc/hosts: a job of several nodes
#                                          refuses a loopback address for any node and says to set NET_IFNAME)
#   SRUN, SCONTROL, RAY, PYTHON            the commands (tests put fakes there)
# Ray's token authentication is on (RAY_AUTH_MODE=token) with a token made for this job (RAY_AUTH_TOKEN, exported
# to every node through srun's environment) unless RAY_AUTH_MODE / RAY_AUTH_TOKEN are set already.

RAY_PORT="${RAY_PORT:-6379}"
RAY_NODE_MANAGER_PORT="${RAY_NODE_MANAGER_PORT:-6380}"
RAY_OBJECT_MANAGER_PORT="${RAY_OBJECT_MANAGER_PORT:-6381}"
RAY_CLIENT_SERVER_PORT="${RAY_CLIENT_SERVER_PORT:-6382}"
RAY_RUNTIME_ENV_AGENT_PORT="${RAY_RUNTIME_ENV_AGENT_PORT:-6383}"
RAY_DASHBOARD_AGENT_GRPC_PORT="${RAY_DASHBOARD_AGENT_GRPC_PORT:-6384}"
RAY_DASHBOARD_AGENT_LISTEN_PORT="${RAY_DASHBOARD_AGENT_LISTEN_PORT:-6385}"
RAY_METRICS_EXPORT_PORT="${RAY_METRICS_EXPORT_PORT:-6386}"
RAY_MIN_WORKER_PORT="${RAY_MIN_WORKER_PORT:-10002}"
RAY_MAX_WORKER_PORT="${RAY_MAX_WORKER_PORT:-10999}"
RAY_JOIN_TIMEOUT_S="${RAY_JOIN_TIMEOUT_S:-300}"
RAY_STOP_TIMEOUT_S="${RAY_STOP_TIMEOUT_S:-30}"
RAY_DRIVER_STOP_S="${RAY_DRIVER_STOP_S:-30}"
SRUN="${SRUN:-srun}"
SCONTROL="${SCONTROL:-scontrol}"
RAY="${RAY:-ray}"
PYTHON="${PYTHON:-python}"
RAY_SLURM_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

RAY_NODES=()       # host names, SLURM's order; the first runs the head (and the batch script, hence the driver)
RAY_SRUN_PIDS=()   # the srun of each node, same order

ray_log() { echo "[ray_cluster] $*" >&2; }

node_ip() {  # this node's address: NET_IFNAME's IPv4 address when it is set, else the host name's
  if [[ -n "${NET_IFNAME:-}" ]]; then
    ip -o -4 addr show dev "$NET_IFNAME" | awk '{split($4, a, "/"); print a[1]; exit}'
  else
    hostname --ip-address | awk '{print $1}'
  fi
}

is_loopback() { [[ "$1" == 127.* || "$1" == ::1 || "$1" == localhost ]]; }

loopback_refusal() {  # $1 = the node, $2 = its address: why a job of several nodes cannot use it
  echo "$1's address is $2, a loopback address (\`hostname --ip-address\` on a stock Debian/Ubuntu /etc/hosts): the" \
    "other nodes cannot reach Ray there and would never join. Set NET_IFNAME to the interface the nodes share" \
    "(e.g. NET_IFNAME=ib0 or eth0; \`ip -o -4 addr\` lists them), or RAY_HEAD_IP for the head"
}

ray_node_start() {  # runs on a node, under srun: $1 = head | worker
  local ip
  ip="$(node_ip)"
  if (( ${RAY_NODE_COUNT:-1} > 1 )) && is_loopback "$ip"; then
    echo "[ray_cluster] $(loopback_refusal "$(hostname)" "$ip")" >&2
    exit 2
  fi
  local args=(start --block --disable-usage-stats
    --node-manager-port="$RAY_NODE_MANAGER_PORT" --object-manager-port="$RAY_OBJECT_MANAGER_PORT"
    --min-worker-port="$RAY_MIN_WORKER_PORT" --max-worker-port="$RAY_MAX_WORKER_PORT"
    --runtime-env-agent-port="$RAY_RUNTIME_ENV_AGENT_PORT"
    --dashboard-agent-grpc-port="$RAY_DASHBOARD_AGENT_GRPC_PORT"
    --dashboard-agent-listen-port="$RAY_DASHBOARD_AGENT_LISTEN_PORT"
    --metrics-export-port="$RAY_METRICS_EXPORT_PORT")
  if [[ -n "$ip" ]]; then args+=(--node-ip-address="$ip"); fi
  if [[ "$1" == head ]]; then
    args+=(--head --port="$RAY_PORT" --ray-client-server-port="$RAY_CLIENT_SERVER_PORT" --include-dashboard=false)
  else
    args+=(--address="$RAY_HEAD_ADDRESS")
  fi
  exec "$RAY" "${args[@]}"
}

_ray_start_node() {  # $1 = index in RAY_NODES, $2 = head | worker
  local node="${RAY_NODES[$1]}"
  # --overlap: the Ray daemons' steps do not hold the node's CPUs and GPUs away from other steps.
  "$SRUN" --nodes=1 --ntasks=1 --overlap -w "$node" bash -c "ray_node_start $2" &
  RAY_SRUN_PIDS[$1]=$!
  ray_log "ray $2 on $node (srun pid ${RAY_SRUN_PIDS[$1]})"
}

ray_check_nodes() {  # 0 while every node's srun runs; else says which one ended, with its status, and returns 1
  local i pid rc
  for i in "${!RAY_SRUN_PIDS[@]}"; do
    pid="${RAY_SRUN_PIDS[$i]}"
    if ! kill -0 "$pid" 2>/dev/null; then
      rc=0
      wait "$pid" 2>/dev/null || rc=$?
      ray_log "node ${RAY_NODES[$i]}: its srun (ray $([[ $i == 0 ]] && echo head || echo worker)) ended with" \
        "status $rc; failing the job instead of waiting on it"
      return 1
    fi
  done
}

_ray_wait_joined() {  # node names...: polls the head until they joined; fails at once if a node's srun ends
  "$PYTHON" "$RAY_SLURM_DIR/wait_for_nodes.py" "$RAY_HEAD_ADDRESS" "$RAY_JOIN_TIMEOUT_S" "$@" &
  local poll=$! rc=0
  while kill -0 "$poll" 2>/dev/null; do
    if ! ray_check_nodes; then
      kill "$poll" 2>/dev/null || true
      return 1
    fi
    sleep 0.5 & wait $! || true  # `wait` (unlike a foreground sleep) lets a trapped signal in at once
  done
  wait "$poll" || rc=$?
  return "$rc"
}

_ray_token() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }

ray_cluster_up() {
  mapfile -t RAY_NODES < <("$SCONTROL" show hostnames "${SLURM_JOB_NODELIST:?not inside a SLURM job}")
  if (( ${#RAY_NODES[@]} == 0 )); then
    ray_log "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST names no node"
    return 1
  fi
  if [[ -n "${NET_IFNAME:-}" ]]; then
    export NCCL_SOCKET_IFNAME="$NET_IFNAME" GLOO_SOCKET_IFNAME="$NET_IFNAME"
  fi
  RAY_HEAD_IP="${RAY_HEAD_IP:-$(node_ip)}"
  if (( ${#RAY_NODES[@]} > 1 )) && is_loopback "$RAY_HEAD_IP"; then
    ray_log "$(loopback_refusal "the head (${RAY_NODES[0]})" "$RAY_HEAD_IP")"
    return 1
  fi
  export RAY_HEAD_ADDRESS="$RAY_HEAD_IP:$RAY_PORT" RAY_NODE_COUNT="${#RAY_NODES[@]}"
  export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
  if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" ]]; then
    export RAY_AUTH_TOKEN; RAY_AUTH_TOKEN="$(_ray_token)"
  fi
  export RAY RAY_PORT RAY_NODE_MANAGER_PORT RAY_OBJECT_MANAGER_PORT RAY_CLIENT_SERVER_PORT RAY_RUNTIME_ENV_AGENT_PORT \
    RAY_DASHBOARD_AGENT_GRPC_PORT RAY_DASHBOARD_AGENT_LISTEN_PORT RAY_METRICS_EXPORT_PORT RAY_MIN_WORKER_PORT \
    RAY_MAX_WORKER_PORT
  export -f ray_node_start node_ip is_loopback loopback_refusal
  ray_log "${#RAY_NODES[@]} node(s): ${RAY_NODES[*]}; head at $RAY_HEAD_ADDRESS"
  _ray_start_node 0 head
  _ray_wait_joined "${RAY_NODES[0]}" || return 1  # workers need the head's GCS up
  local i
  for (( i = 1; i < ${#RAY_NODES[@]}; i++ )); do _ray_start_node "$i" worker; done
  _ray_wait_joined "${RAY_NODES[@]}" || return 1
}

ray_watch() {  # $1 = the driver's pid
  local driver=$1 rc=0 waited
  while kill -0 "$driver" 2>/dev/null; do
    if ! ray_check_nodes; then
      kill -TERM "$driver" 2>/dev/null || true
      for (( waited = 0; waited < RAY_DRIVER_STOP_S * 2; waited++ )); do
        kill -0 "$driver" 2>/dev/null || break
        sleep 0.5
      done
      kill -KILL "$driver" 2>/dev/null || true
      wait "$driver" 2>/dev/null || true
      return 1
    fi
    sleep 0.5 & wait $! || true
  done
  wait "$driver" || rc=$?
  return "$rc"
}

ray_cluster_down() {
  local pid waited
  (( ${#RAY_SRUN_PIDS[@]} )) || return 0
  for pid in "${RAY_SRUN_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for (( waited = 0; waited < RAY_STOP_TIMEOUT_S * 2; waited++ )); do
    for pid in "${RAY_SRUN_PIDS[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then sleep 0.5; continue 2; fi
    done
    break
  done
  for pid in "${RAY_SRUN_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait "${RAY_SRUN_PIDS[@]}" 2>/dev/null || true
  ray_log "Ray stopped on ${RAY_NODES[*]}"
  RAY_SRUN_PIDS=()
}
