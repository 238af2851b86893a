# Argument checks of tools/dist_*.sh and tools/slurm_*.sh (sourced; each
# sets PROG and USAGE first). A mistake prints the usage line and what is
# wrong, and exits with 2 before anything starts, as argparse does.

usage_error() {
    echo "$USAGE" >&2
    echo "$PROG: error: $1" >&2
    exit 2
}

# is_count VALUE: a whole number >= 1.
is_count() {
    case "$1" in
        '' | *[!0-9]* | 0 | 0*) return 1 ;;
    esac
}

# is_config PATH: named like a config file MMEngine reads.
is_config() {
    case "$1" in
        *.py | *.json | *.yaml | *.yml) return 0 ;;
    esac
    return 1
}

# check_count NAME VALUE
check_count() {
    is_count "$2" || usage_error "$1 should be a whole number >= 1, but got '$2'"
}

# check_config CONFIG: an existing config file.
check_config() {
    is_config "$1" ||
        usage_error "CONFIG '$1' is not a config file (.py, .json, .yaml or .yml)"
    [ -f "$1" ] || usage_error "CONFIG '$1': no such file"
}

# help_requested "$@": the usage line for -h or --help first.
help_requested() {
    case "$1" in
        -h | --help)
            echo "$USAGE"
            return 0
            ;;
    esac
    return 1
}
