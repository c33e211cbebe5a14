from django.urls import path

from monitoring import apis, probe_apis, sensing_apis

urlpatterns = [
    path("monitoring", apis.MonitoringApi.as_view(), name="monitoring"),
    path("monitoring/configure", apis.MonitoringConfigureApi.as_view(), name="monitoring-configure"),
    # the original's shortcut, kept for its clients
    path("saes/monitoring", apis.MonitoringConfigureApi.as_view(), name="sae-monitoring"),
    path("monitoring/enable", apis.MonitoringEnableApi.as_view(), name="monitoring-enable"),
    path("monitoring/sensing", sensing_apis.SensingApi.as_view(), name="monitoring-sensing"),
    path("monitoring/history", apis.HistoryApi.as_view(), name="monitoring-history"),
    path("monitoring/statistics", apis.StatisticsApi.as_view(), name="monitoring-statistics"),
    path("monitoring/statistics/top", apis.StatisticsTopApi.as_view(), name="monitoring-statistics-top"),
    path("probes", probe_apis.ProbeListApi.as_view(), name="probes"),
    path("probes/import", probe_apis.ProbeImportApi.as_view(), name="probes-import"),
    path("probes/<str:ref>", probe_apis.ProbeDetailApi.as_view(), name="probe"),
    path("probes/<str:ref>/validate", probe_apis.ProbeValidateApi.as_view(), name="probe-validate"),
    path("probes/<str:ref>/arm", probe_apis.ProbeArmApi.as_view(), name="probe-arm"),
    path("probes/<str:ref>/disarm", probe_apis.ProbeDisarmApi.as_view(), name="probe-disarm"),
    path("captures", apis.CaptureListApi.as_view(), name="captures"),
    path("captures/<str:capture_id>", apis.CaptureDetailApi.as_view(), name="capture"),
    path("captures/<str:capture_id>/analyze", apis.CaptureAnalyzeApi.as_view(), name="capture-analyze"),
    path("captures/<str:capture_id>/download", apis.CaptureDownloadApi.as_view(), name="capture-download"),
]
