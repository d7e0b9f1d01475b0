"""The one config object that alerts (and, later, dashboards) read: selectors, SLOs, thresholds, `for`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stepline.config.slo import Slo

if TYPE_CHECKING:
    from stepline.alerting.receivers import Receiver


@dataclass(frozen=True)
class AlertConfig:
    """Every selector, threshold and duration the alert rules use (node-mixin style)."""

    selector: str = 'job="stepline"'
    """Label matchers selecting the collector's own /metrics target(s)."""
    slo: Slo = field(default_factory=Slo)

    engine_down_for: str = "1m"
    """Patience with an engine whose scrape fails otherwise than refused or gone: a timeout may be a busy engine."""
    engine_gone_reasons: tuple[str, ...] = ("refused", "gone")
    """Scrape failures (`stepline_source_failure_info{reason}`) that say the engine's process is not there: nothing
    listens on its port, or it closed the connection without an answer. EngineGone pages them at once."""
    engine_gone_for: str = "0m"
    """A refused connection is no slow engine: the patience is the collector's scrape, Prometheus' scrape and the fast
    group's evaluation (5 s each by default), and Alertmanager's 10 s group wait: within 25 s of the crash."""
    stalled_for: str = "0m"
    """Extra patience beyond the watchdog budget: none by default, the budget (ten times the step the work in
    flight should take, 5 s at least) is the patience, so a wedge pages within its budget, a scrape and a rule
    evaluation."""
    wedge_min_age_seconds: float = 30.0
    """No progress for this long with a queue and idle GPUs is a wedge, however large the budget (a huge
    prefill's); sooner when the budget says so."""
    wedge_gpu_idle_ratio: float = 0.05
    wedged_for: str = "1m"
    """EngineStalled pages a wedge first (at its budget); this page, which says "wedged", waits out a queue or
    GPU reading that flaps."""
    starvation_min_prefill_share: float = 0.2
    """Share of recent steps carrying prefill above which slow decode is blamed on prefill."""
    starvation_for: str = "1m"
    starvation_critical_for: str = "1m"
    hol_blocked_for: str = "0m"
    """The gauge counts queued requests only once a long prefill has run for 10 s: that is the patience, and the
    page fires while the queue is still growing."""
    hol_critical_requests: int = 10
    hol_critical_for: str = "1m"
    diagnosed_kinds: tuple[str, ...] = ("gpu_throttling", "overload", "spec_decode_acceptance_shift", "lane_leak",
                                        "orphaned_engine_work")
    """Causes the watchdog's diagnosis names that no other alert tells (a power cap holding clocks down, arrivals
    above capacity, speculative acceptance falling, monsters a gateway sent to the fast lane under a bar in the wrong
    unit, engine work for clients that left): EngineDiagnosed tickets them, its text the finding."""
    gateway_leaked_slots: int = 2
    """A gateway holding this many more requests in flight to a backend than the engine runs and queues, through
    the whole lookback, leaked them (released on success or failure, never on a client's disconnect)."""
    gateway_leak_lookback: str = "5m"
    gateway_leak_for: str = "5m"
    gateway_fail_open_decisions: int = 3
    """Routing decisions that failed open (a hook swallowed an exception, or measured nothing against its bar) in
    gateway_fail_open_window before a gateway is ticketed."""
    gateway_fail_open_window: str = "10m"
    diagnosed_for: str = "1m"
    plugin_silent_for: str = "1m"
    """The watchdog calls a plugin silent after 30 s of the engine's counters moving without a step
    (`watchdog.budget.Policy.plugin_silent_after_s`); this long more before a ticket."""
    prefix_cache_drop_factor: float = 0.5
    """Hit ratio below this fraction of its own 1 h average is a collapse."""
    prefix_cache_min_baseline: float = 0.3
    """Below this 1 h average the cache was never doing much: no alert."""
    prefix_cache_for: str = "10m"
    kv_usage_warning_ratio: float = 0.9
    kv_usage_critical_ratio: float = 0.97
    kv_preemptions_critical_per_5m: int = 50
    kv_for: str = "5m"
    throttle_reasons: tuple[str, ...] = (
        "hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown",
    )
    """Clock-event reasons that mean trouble; sw_power_cap under load is normal and left out."""
    throttle_for: str = "5m"
    throttle_critical_for: str = "30m"
    xid_window: str = "10m"
    fatal_xids: tuple[int, ...] = (48, 74, 79, 94, 95, 119, 120)
    """XIDs that mean the GPU or its memory needs attention now (DBE, NVLink, off the bus, ECC, GSP)."""
    drop_window: str = "5m"
    drop_for: str = "5m"
    drop_critical_rows_per_second: float = 100.0
    dropped_source_counters: tuple[str, ...] = ("plugin_dropped_records", "lost_datagrams")
    store_unavailable_for: str = "5m"
    spool_critical_ratio: float = 0.8
    """Past this share of its bound the spool is about to drop the oldest batches."""
    source_down_for: str = "10m"
    gpu_present_lookback: str = "1d"
    """The gpu source being down is expected only where no GPU was seen over this window."""

    runbook_url: str = "https://github.com/stepline/stepline/blob/main/alerts/runbook.md#{anchor}"
    """`{anchor}` is the lower-cased alert name."""
    diagnose_since: str = "30m"
    group_name: str = "stepline"
    evaluation_interval: str = "30s"
    fast_group_name: str = "stepline-fast"
    fast_evaluation_interval: str = "5s"
    """The rules that must page within 30 s of their cause (EngineGone) are evaluated this often, in a group of their
    own: the main group's 30 s alone would spend that budget, and evaluating every rule (1 h windows among them)
    this often would cost a fleet's Prometheus six times as much. Grafana evaluates at most every 10 s."""

    receivers: tuple[Receiver, ...] = ()
    """Who is told, per route: critical alerts page (Alertmanager receiver `stepline-page`), warnings ticket
    (`stepline-ticket`, also whatever no route matches), the Watchdog goes to `heartbeat` (`receivers.Receiver`,
    `stepline alerts build --receiver ROUTE=KIND:KEY=VALUE,...`). A route none is named for keeps its default: page
    and ticket post to one Slack incoming webhook whose URL Alertmanager reads from `slack_api_url_file` on every
    notification, and the heartbeat goes nowhere until it is pointed at a dead man's switch.

    Why Slack: it reaches a person with one secret, and that secret stays in a file (a Kubernetes or Compose secret)
    rather than in the config. Alertmanager 0.25's webhook has no `url_file`, so a webhook default would put its URL
    in the config, or point at a port where nothing listens. Until the file exists, every notification fails naming
    it in Alertmanager's log and in `alertmanager_notifications_failed_total{integration="slack"}`: a visible
    failure, not a page sent nowhere."""
    slack_api_url_file: str = "/etc/alertmanager/secrets/slack_api_url"
    """The default receivers' Slack incoming-webhook URL, as a file in Alertmanager's container."""
    grafana_via_alertmanager: bool = False
    """Grafana forwards every alert to `grafana_alertmanager_url`, even on routes with receivers named (whose
    Grafana-managed alerts Grafana otherwise delivers itself, without Alertmanager's inhibit rules)."""
    webhook_url: str = ""
    """When set, the page and ticket defaults post to this webhook instead of Slack (the loopback test stacks'
    receiver, `stepline.testing.alertstack`)."""
    heartbeat_url: str = ""
    """When set, the heartbeat's default posts to this webhook."""
    grafana_alertmanager_url: str = "http://alertmanager:9093"
    """Grafana's contact point forwards the Grafana-managed alerts of every route with no receiver named to this
    Alertmanager (it posts to `/api/v2/alerts` under it): deploy/docker-compose.yml's `alertmanager` service, so
    both alert paths are routed, grouped and inhibited by the same Alertmanager."""
    grafana_datasource_uid: str = "${STEPLINE_PROMETHEUS_UID}"
    """Grafana expands this from its environment when it reads the provisioning file."""
    grafana_folder_uid: str = "stepline"

    def sel(self, *matchers: str) -> str:
        """`{selector, matchers...}` for a metric."""
        return "{" + ", ".join(m for m in (self.selector, *matchers) if m) + "}"

    def runbook(self, alert: str) -> str:
        return self.runbook_url.format(anchor=alert.lower())
