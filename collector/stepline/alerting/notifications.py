"""What a page says: the title and text every receiver sends, in Alertmanager's and Grafana's Go templates."""

# What a receiver tells a person, Alertmanager's and Grafana's alike: both run Go templates over the same notification
# data (Status, Alerts with their Annotations, CommonLabels). The title names the alert, its engine and the cause (the
# first alert's summary); the text gives every alert's summary, description and runbook. No `$` in them: Grafana's
# provisioning would expand it from its environment (receivers.py).
NOTIFICATION_TITLE = ("[{{ .Status | toUpper }}] {{ .CommonLabels.alertname }}"
                      "{{ with .CommonLabels.engine }} on {{ . }}{{ end }}: "
                      "{{ with index .Alerts 0 }}{{ .Annotations.summary }}{{ end }}")
NOTIFICATION_TEXT = ('{{ range .Alerts }}{{ if eq .Status "resolved" }}Resolved: {{ end }}{{ .Annotations.summary }}\n'
                     "{{ .Annotations.description }}\n"
                     "Runbook: {{ .Annotations.runbook_url }}\n"
                     "{{ end }}")
PAGERDUTY_SEVERITY = ('{{ if eq .CommonLabels.severity "critical" }}critical'
                      '{{ else if eq .CommonLabels.severity "warning" }}warning{{ else }}info{{ end }}')
"""PagerDuty's Events API v2 knows critical, error, warning and info."""
