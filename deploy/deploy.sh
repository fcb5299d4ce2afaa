#!/usr/bin/env bash
# Deploy swarmtrain to a Docker Swarm: build the image, make the cluster secret, label the
# nodes, deploy the stack (deploy/docker-stack.yml). Run `deploy/deploy.sh --help`.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
# SWARMTRAIN_STACK_FILE=deploy/docker-stack-sharded.yml deploys two parameter servers
STACK_FILE="${SWARMTRAIN_STACK_FILE:-$HERE/docker-stack.yml}"
SECRET_NAME=swarmtrain_secret                  # the name docker-stack.yml declares (external)
LOCAL_SECRET="$HERE/secrets/swarmtrain_secret" # the file docker-compose.yml mounts
PLATFORMS=linux/amd64,linux/arm64
IMAGE=${SWARMTRAIN_IMAGE:-swarmtrain:0.1.0}
STACK=swarmtrain
DRY_RUN=0

usage() {
    cat <<EOF
Usage: deploy/deploy.sh [--dry-run] COMMAND [ARGS]

Deploy swarmtrain to a Docker Swarm. Run it on a Swarm manager, in this order:

  build --image IMAGE [--no-push]
        build the image for $PLATFORMS with docker buildx and push it
        (every node pulls IMAGE, so name a registry they can reach)
  secret [FILE]
        create the Docker secret $SECRET_NAME from FILE; without FILE, from
        deploy/secrets/swarmtrain_secret, written first with a new random secret if missing
  label NODE=CLASS [NODE=CLASS...]
        label Swarm nodes; CLASS is one of
          coordinator  runs the coordinator       (swarmtrain.role=coordinator)
          rpi          runs a Raspberry Pi worker (swarmtrain.profile=rpi)
          pc           runs a laptop/desktop/server worker (swarmtrain.profile=pc)
          server1      runs parameter server 1 of docker-stack-sharded.yml (swarmtrain.server=1)
        a node may carry coordinator and one worker class: box=coordinator box=pc
  up [--image IMAGE] [--stack NAME]
        deploy or update the stack (default image \$SWARMTRAIN_IMAGE or swarmtrain:0.1.0,
        default stack name swarmtrain); configs are named by a hash of deploy/config/*.toml,
        so an edited TOML file reaches the services on the next 'up'
  down [--stack NAME]
        remove the stack (the secret, labels and checkpoint volume stay)
  local-secret [FILE]
        write a new random secret to FILE (default deploy/secrets/swarmtrain_secret) for
        docker compose -f deploy/docker-compose.yml up

Options:
  -n, --dry-run   print the docker commands instead of running them (no Docker engine needed)
  -h, --help      show this help

Example:
  deploy/deploy.sh build --image registry.lan:5000/swarmtrain:0.1.0
  deploy/deploy.sh secret
  deploy/deploy.sh label box=coordinator box=pc pi1=rpi pi2=rpi
  deploy/deploy.sh up --image registry.lan:5000/swarmtrain:0.1.0
EOF
}

die() {  # an error of the environment: exit 1
    echo "deploy.sh: error: $*" >&2
    exit 1
}

usage_error() {  # a wrong command line: exit 2
    echo "deploy.sh: error: $*" >&2
    echo "Run 'deploy/deploy.sh --help' for usage." >&2
    exit 2
}

quote() {  # ARG as the shell reads it back: bare when safe, else in single quotes
    if [[ $1 =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

run() {  # run a command, or print it under --dry-run
    if [ "$DRY_RUN" = 1 ]; then
        local arg sep=""
        for arg in "$@"; do
            printf '%s' "$sep"
            quote "$arg"
            sep=" "
        done
        echo
    else
        "$@"
    fi
}

need_docker() {
    [ "$DRY_RUN" = 1 ] && return 0
    command -v docker >/dev/null 2>&1 \
        || die "docker not found on PATH: install Docker Engine (20.10 or newer) on this machine"
}

need_manager() {  # the Swarm commands work only on a manager node
    [ "$DRY_RUN" = 1 ] && return 0
    need_docker
    local state
    state=$(docker info --format '{{.Swarm.LocalNodeState}} {{.Swarm.ControlAvailable}}' 2>/dev/null) \
        || die "cannot reach the Docker engine: is it running, and may this user use it? ('docker info' tells)"
    case "$state" in
        "active true") ;;
        "active false") die "this node is a Swarm worker, not a manager: run deploy.sh on a manager" \
                            "(docker node ls, run on a manager, lists them)" ;;
        inactive*) die "this Docker engine is not part of a swarm: run 'docker swarm init' here," \
                       "then the 'docker swarm join' command it prints on every other node" ;;
        *) die "this node's Swarm state is '$state', not 'active': see 'docker info'" ;;
    esac
}

write_secret() {  # FILE: a new random secret, 64 hex digits
    local file=$1
    [ -e "$file" ] && die "$file exists already; remove it first to make a new secret"
    if [ "$DRY_RUN" = 1 ]; then
        echo "# would write a new random secret to $file"
        return 0
    fi
    # The directory keeps other users out; the file itself is 0644 because docker compose
    # bind-mounts it unchanged and the image's user (uid 10001) must read it.
    local dir
    dir=$(dirname "$file")
    if [ ! -d "$dir" ]; then
        mkdir -p "$dir" && chmod 700 "$dir"
    elif [ -n "$(find "$dir" -maxdepth 0 -perm -o+x)" ]; then
        echo "deploy.sh: warning: other users can enter $dir; the secret in it is readable (0644)" >&2
    fi
    (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$file")
    chmod 644 "$file"
    echo "wrote a new cluster secret to $file"
}

config_version() {  # a short hash of the TOML files the stack mounts
    local sum
    if command -v sha256sum >/dev/null 2>&1; then sum=(sha256sum); else sum=(shasum -a 256); fi
    cat "$HERE"/config/*.toml | "${sum[@]}" | cut -c1-12
}

cmd_build() {
    local push=--push
    while [ $# -gt 0 ]; do
        case "$1" in
            --image) [ $# -ge 2 ] || usage_error "--image needs a value"; IMAGE=$2; shift 2 ;;
            --no-push) push=--load; shift ;;
            *) usage_error "build: unknown argument '$1'" ;;
        esac
    done
    need_docker
    if [ "$push" = --load ]; then
        # --load can hold one platform only: build for this machine's
        run docker buildx build -f "$HERE/Dockerfile" -t "$IMAGE" --load "$ROOT"
    else
        run docker buildx build --platform "$PLATFORMS" -f "$HERE/Dockerfile" -t "$IMAGE" --push "$ROOT"
    fi
}

cmd_secret() {
    [ $# -le 1 ] || usage_error "secret takes at most one FILE"
    local file=${1:-}
    need_manager
    if [ "$DRY_RUN" = 0 ] && docker secret inspect "$SECRET_NAME" >/dev/null 2>&1; then
        die "the Docker secret $SECRET_NAME exists already (a secret cannot change); to replace it:" \
            "deploy.sh down, docker secret rm $SECRET_NAME, deploy.sh secret FILE, deploy.sh up"
    fi
    if [ -z "$file" ]; then
        file=$LOCAL_SECRET
        [ -e "$file" ] || write_secret "$file"
    else
        [ -f "$file" ] || die "secret file $file not found: make one with" \
                              "'swarmtrain secret --out $file', or leave FILE out to generate one"
        [ -s "$file" ] || die "secret file $file is empty"
    fi
    run docker secret create "$SECRET_NAME" "$file"
}

cmd_label() {
    [ $# -ge 1 ] || usage_error "label needs at least one NODE=CLASS (CLASS: coordinator, rpi or pc)"
    local pair node class nodes=() labels=() i
    for pair in "$@"; do  # check every pair before labelling any node
        node=${pair%%=*}
        class=${pair#*=}
        [ "$pair" != "$node" ] && [ -n "$node" ] && [ -n "$class" ] \
            || usage_error "'$pair' is not NODE=CLASS (CLASS: coordinator, rpi or pc)"
        case "$class" in
            coordinator) labels+=(swarmtrain.role=coordinator) ;;
            rpi|pc) labels+=("swarmtrain.profile=$class") ;;
            server1) labels+=(swarmtrain.server=1) ;;
            *) usage_error "unknown class '$class' for node $node: use coordinator, server1, rpi or pc" ;;
        esac
        nodes+=("$node")
    done
    need_manager
    for i in "${!nodes[@]}"; do
        run docker node update --label-add "${labels[$i]}" "${nodes[$i]}"
    done
}

stack_option() {  # parse --image / --stack for up and down into IMAGE and STACK
    while [ $# -gt 0 ]; do
        case "$1" in
            --image) [ $# -ge 2 ] || usage_error "--image needs a value"; IMAGE=$2; shift 2 ;;
            --stack) [ $# -ge 2 ] || usage_error "--stack needs a value"; STACK=$2; shift 2 ;;
            *) usage_error "unknown argument '$1'" ;;
        esac
    done
}

cmd_up() {
    stack_option "$@"
    need_manager
    if [ "$DRY_RUN" = 0 ]; then
        docker secret inspect "$SECRET_NAME" >/dev/null 2>&1 \
            || die "the Docker secret $SECRET_NAME does not exist: run 'deploy/deploy.sh secret' first"
        [ -n "$(docker node ls -q --filter node.label=swarmtrain.role=coordinator)" ] \
            || die "no node is labelled swarmtrain.role=coordinator, so the coordinator could not" \
                   "start: run 'deploy/deploy.sh label NODE=coordinator' first"
    fi
    if [[ "$IMAGE" != */* ]]; then
        echo "deploy.sh: warning: image $IMAGE names no registry: every node must have it already" \
             "(see 'deploy.sh build')" >&2
    fi
    run env SWARMTRAIN_IMAGE="$IMAGE" SWARMTRAIN_CONFIG_VERSION="$(config_version)" \
        docker stack deploy --with-registry-auth --prune -c "$STACK_FILE" "$STACK"
}

cmd_down() {
    stack_option "$@"
    need_manager
    run docker stack rm "$STACK"
}

main() {
    local args=() arg
    for arg in "$@"; do
        case "$arg" in
            -h|--help) usage; exit 0 ;;
            -n|--dry-run) DRY_RUN=1 ;;
            *) args+=("$arg") ;;
        esac
    done
    [ ${#args[@]} -ge 1 ] || usage_error "no command given"
    local command=${args[0]}
    local rest=("${args[@]:1}")
    case "$command" in
        build) cmd_build "${rest[@]}" ;;
        secret) cmd_secret "${rest[@]}" ;;
        label) cmd_label "${rest[@]}" ;;
        up) cmd_up "${rest[@]}" ;;
        down) cmd_down "${rest[@]}" ;;
        local-secret)
            [ ${#rest[@]} -le 1 ] || usage_error "local-secret takes at most one FILE"
            write_secret "${rest[0]:-$LOCAL_SECRET}" ;;
        *) usage_error "unknown command '$command' (build, secret, label, up, down, local-secret)" ;;
    esac
}

main "$@"
