from django.urls import path

from monitoring import apis

urlpatterns = [
    path("monitoring", apis.MonitoringApi.as_view(), name="monitoring"),
    path("monitoring/configure", apis.MonitoringConfigureApi.as_view(),
         name="monitoring-configure"),
    # the original's shortcut, kept for its clients
    path("saes/monitoring", apis.MonitoringConfigureApi.as_view(), name="sae-monitoring"),
    path("monitoring/enable", apis.MonitoringEnableApi.as_view(), name="monitoring-enable"),
    path("monitoring/history", apis.HistoryApi.as_view(), name="monitoring-history"),
    path("monitoring/statistics", apis.StatisticsApi.as_view(), name="monitoring-statistics"),
    path("monitoring/statistics/top", apis.StatisticsTopApi.as_view(),
         name="monitoring-statistics-top"),
]
