"""The ``vllm.general_plugins`` entry point of vllm-wa.

vLLM loads it in every process.  Without ``--wa-online`` it only adds the
``--wa-*`` options to ``vllm serve`` (so they show in ``--help`` and parse):
same queue, same routes, same metrics.  With ``--wa-online``:

* in the API server, once the arguments are parsed, it checks the vLLM
  version and the config files (refusing to start with a clear message),
  publishes the settings to the environment, and installs the routes, the
  metrics poller and the reply-outcome watcher;
* in the engine core (spawned; it inherits the environment), it installs the
  workload-aware queue and the online controller when the scheduler is built;
* in vLLM's extra API-server processes (several API servers, data
  parallelism), it installs the API-server side from the inherited settings.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
from typing import Any

from vllm_wa.serving.settings import ENV_ONLINE, ServingSettings, SettingsError, metrics_interval_from_env

logger = logging.getLogger(__name__)
_WRAPPED = "__vllm_wa_wrapped__"
_cli_hooked = False
# The --wa-* options that do something only with --wa-online.
_WA_OPTIONS = ("wa_config", "wa_params", "wa_allow_pin", "wa_bench_outcome_hints", "wa_public_params")


# vLLM's name for the extra API-server processes (``--api-server-count``, which
# data parallelism raises to the number of engines).
_API_SERVER_PROCESS_PREFIX = "ApiServer"


def register() -> None:
    """Entry point; cheap and idempotent (it runs in every vLLM process)."""
    _install_cli_options()
    try:
        settings = ServingSettings.from_env()
    except SettingsError as e:
        raise SystemExit(f"vllm-wa: {e}") from None
    if settings.online:
        from vllm_wa.engine_patch.compat import UnsupportedVLLMError
        from vllm_wa.serving import engine_side

        try:
            engine_side.install()
        except UnsupportedVLLMError as e:
            raise SystemExit(f"vllm-wa: {ENV_ONLINE}=1 is set in the environment, and {e}") from None
        if multiprocessing.current_process().name.startswith(_API_SERVER_PROCESS_PREFIX):
            # An extra API server parses the arguments before it loads plugins,
            # so enable_online() does not run there; the parent process checked
            # the flags and exported the settings this process inherited.
            from vllm_wa.serving import api_side

            api_side.install(settings)
            _install_outcome_hints(settings)


def _install_outcome_hints(settings: ServingSettings) -> None:
    """The benchmark's outcome hints, in every process that serves HTTP."""
    if settings.bench_outcome_hints:
        from vllm_wa.serving import outcome_hints

        outcome_hints.install()


def add_cli_options(parser: Any) -> None:
    if any("--wa-online" in a.option_strings for a in getattr(parser, "_actions", ())):
        return
    g = parser.add_argument_group("vllm-wa", "Workload-aware, self-tuning prefix-cache eviction")
    g.add_argument("--wa-online", action="store_true", default=False,
                   help="Evict prefix-cache blocks by each workload's learned reuse model (vllm-wa).")
    g.add_argument("--wa-config", type=str, default=None,
                   help="TOML config of the vllm-wa controller (see configs/controller.toml).")
    g.add_argument("--wa-params", type=str, default=None,
                   help="Seed parameters in the PR #22236 JSON format ({'a': {...}, 'p': {...}}).")
    g.add_argument("--wa-allow-pin", action="store_true", default=False,
                   help="Allow PUT /wa/params to pin parameters (needs the API key when one is set).")
    g.add_argument("--wa-bench-outcome-hints", action="store_true", default=False,
                   help="BENCHMARK HOOK, not for production: let a request set how its reply ended "
                   "(vllm_xargs.wa_outcome = tool|stop|length), as vllm-wa bench-serve does to replay a "
                   "trace's outcomes with a model that calls no tools. Needs --wa-online.")
    g.add_argument("--wa-public-params", action="store_true", default=False,
                   help="Serve GET /wa/params without the API key (it lists every client's tag names).")


def _install_cli_options() -> None:
    """Hook the parser of ``vllm serve`` and the step that turns args into EngineArgs."""
    global _cli_hooked
    if _cli_hooked:
        return
    _cli_hooked = True
    try:
        _hook_cli()
    except Exception as e:  # noqa: BLE001 -- another vLLM's API: plain vLLM must still start
        logger.warning("vllm-wa: cannot add the --wa-* options to this vLLM (%s: %s); vllm-wa stays off",
                       type(e).__name__, e)


def _hook_cli() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    # Both originals first: a vLLM without either gets neither hook.
    orig_pre = current_platform.pre_register_and_update
    hooked_from = getattr(EngineArgs.from_cli_args, _WRAPPED, None)
    orig_from = hooked_from or EngineArgs.from_cli_args.__func__
    if getattr(orig_pre, _WRAPPED, None) is None:

        @functools.wraps(orig_pre)
        def pre_register_and_update(*args: Any, **kwargs: Any) -> Any:
            out = orig_pre(*args, **kwargs)
            parser = args[0] if args else kwargs.get("parser")
            if parser is not None:
                add_cli_options(parser)
            return out

        # vLLM calls this with the serve parser right after loading plugins,
        # before parsing (the only point where a plugin sees the parser).
        setattr(pre_register_and_update, _WRAPPED, orig_pre)
        current_platform.pre_register_and_update = pre_register_and_update

    if hooked_from is None:

        @functools.wraps(orig_from)
        def from_cli_args(cls: Any, args: Any, *a: Any, **kw: Any) -> Any:
            if getattr(args, "wa_online", False):
                enable_online(args)
            else:
                ignored = [f"--{o.replace('_', '-')}" for o in _WA_OPTIONS if getattr(args, o, None)]
                if ignored:
                    logger.warning("vllm-wa: %s have no effect without --wa-online", ", ".join(ignored))
            return orig_from(cls, args, *a, **kw)

        setattr(from_cli_args, _WRAPPED, orig_from)
        EngineArgs.from_cli_args = classmethod(from_cli_args)


def enable_online(args: Any) -> ServingSettings:
    """Validate ``--wa-*`` and switch this process (and its children) to online mode.

    Raises ``SystemExit`` with the reason when the server must not start.
    """
    from vllm_wa.controller.config import ConfigError, ControllerConfig, read_config_bytes
    from vllm_wa.engine_patch.compat import UnsupportedVLLMError, check_vllm_version
    from vllm_wa.params import ParamsError, WAParams, read_params_bytes
    from vllm_wa.serving.start_files import private_copy

    config_path = getattr(args, "wa_config", None)
    params_path = getattr(args, "wa_params", None)
    try:
        check_vllm_version()
        # Each file is read once; the engines get a private copy of the bytes checked here.
        config_bytes = read_config_bytes(config_path) if config_path else None
        config = ControllerConfig.parse(config_bytes, config_path) if config_bytes is not None else ControllerConfig()
        seed_bytes = read_params_bytes(config.seed_params) if config.seed_params else None
        if seed_bytes is not None:  # what the engine core would load 60 s later
            WAParams.parse(seed_bytes, config.seed_params, max_classes=config.max_classes)
        params_bytes = read_params_bytes(params_path) if params_path else None
        if params_bytes is not None:
            WAParams.parse(params_bytes, params_path, max_classes=config.max_classes)
        metrics_interval = metrics_interval_from_env()
    except (UnsupportedVLLMError, ConfigError, ParamsError, SettingsError) as e:
        raise SystemExit(f"vllm-wa: refusing to start with --wa-online: {e}") from None
    if getattr(args, "enable_prefix_caching", None) is False:
        raise SystemExit("vllm-wa: --wa-online needs prefix caching; drop --no-enable-prefix-caching")
    settings = ServingSettings(
        online=True,
        config_path=private_copy(config_bytes, "controller.toml") if config_bytes is not None else None,
        params_path=private_copy(params_bytes, "params.json") if params_bytes is not None else None,
        seed_params_path=private_copy(seed_bytes, "seed_params.json") if seed_bytes is not None else None,
        allow_pin=bool(getattr(args, "wa_allow_pin", False)),
        metrics_interval_s=metrics_interval,
        bench_outcome_hints=bool(getattr(args, "wa_bench_outcome_hints", False)),
        public_params=bool(getattr(args, "wa_public_params", False)),
    )
    settings.export()
    from vllm_wa.serving import api_side

    api_side.install(settings)
    _install_outcome_hints(settings)
    logger.info(
        "vllm-wa: --wa-online enabled (config %s, parameters %s, read once; pinning %s)",
        config_path or "default", params_path or "none", "allowed" if settings.allow_pin else "disabled",
    )
    return settings
