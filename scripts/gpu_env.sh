# Sourced by scripts/gpu_campaign.sh and scripts/gpu_probe.sh: the Python packages a fresh GPU
# machine lacks (from the carried wheels), PYTHONPATH, and llama.cpp (the installed build, or
# one built from the carried source in the background, detached, when START_BUILD=1).
# Needs: PY, LOG, WORK, LIBS and a log function; sets PYTHONPATH and, for the carried build,
# LD_PRELOAD. BUILD_NICE: the build's niceness (10; 0 where nothing runs beside it).
# 1. packages the machine lacks (none where smcspec's are installed: the rehearsal)
if ! "$PY" -c "import fastapi, gguf, llguidance, uvicorn" >/dev/null 2>&1 \
    && ls .campaign/wheels/*.whl >/dev/null 2>&1; then
    if [ ! -f "$WORK/site/.done" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" .campaign/wheels/*.whl >>"$LOG" 2>&1 \
            || { log "installing the carried wheels failed"; exit 1; }
        touch "$WORK/site/.done"
    fi
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import smcspec" 2>>"$LOG" || { log "smcspec does not import (see $LOG)"; exit 1; }

# 2. llama.cpp: the installed build, or one built here from the carried source
if "$PY" -c "import llama_cpp" >/dev/null 2>&1; then
    log "llama_cpp is installed: no build"
elif [ -d .campaign/llama.cpp ] && [ -d .campaign/llama_cpp ]; then
    export PYTHONPATH="$PWD/.campaign:$PYTHONPATH"
    # On the H200 (CUDA 13, 2026-11-26) this build's libggml-cuda.so exported libstdc++'s own
    # symbols (std::ostream, std::codecvt), and libllama bound to them and crashed in
    # llama_model_load (SIGSEGV in print_info, on the CPU path too). Loading the system
    # libstdc++ first makes every library bind to it; with it, the llamacpp GPU tests passed.
    stdcxx=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
    [ -n "$stdcxx" ] && export LD_PRELOAD="$stdcxx${LD_PRELOAD:+:$LD_PRELOAD}"
    if [ "${START_BUILD:-1}" = 1 ] && [ ! -f "$WORK/build.started" ]; then
        touch "$WORK/build.started"
        log "building llama.cpp in the background (log: build.log)"
        # then llama.cpp's own llama-speculative in the same build folder (benchmarks only)
        setsid nohup nice -n "${BUILD_NICE:-10}" bash -c "bash scripts/build_llamacpp_libs.sh .campaign/llama.cpp '$LIBS' \
            && touch '$WORK/build.ok'; touch '$WORK/build.done'; \
            bash scripts/build_llamacpp_libs.sh --tools .campaign/llama.cpp '$LIBS'; \
            touch '$WORK/tools.done'" >"$WORK/build.log" 2>&1 </dev/null &
    fi
else
    log "no llama_cpp and no carried source (.campaign/): the llamacpp backend is skipped"
fi

