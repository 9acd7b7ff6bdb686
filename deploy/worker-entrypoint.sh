#!/bin/bash
# Worker entrypoint: on NPU images, source CANN's environment and check the devices are mounted,
# so a missing driver is one clear line instead of a stack trace from deep inside torch_npu. bash, not
# sh: NNAL's atb/set_env.sh uses bash syntax (`[[ ]]`, `function`, BASH_SOURCE), and dash stops on it.
set -e
if [ "${TOKENLINE_ACCELERATOR:-cpu}" = npu ]; then
    for env_script in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
        # shellcheck disable=SC1090
        if [ -f "$env_script" ]; then . "$env_script"; fi
    done
    if [ ! -e /dev/davinci_manager ]; then
        echo "tokenline worker: /dev/davinci_manager is missing: start it with docker-compose.npu.yml," \
            "which mounts the NPU devices, the driver and npu-smi" >&2
        exit 2
    fi
    if [ ! -d /usr/local/Ascend/driver/lib64 ]; then
        echo "tokenline worker: the Ascend driver is not mounted at /usr/local/Ascend/driver" >&2
        exit 2
    fi
fi
exec "$@"
