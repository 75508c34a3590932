"""The webhook domain every service that announces to on-call shares: the body (payload), its
signature (signing), the signing secrets at rest (secretbox), one HTTP attempt (sender) and
turning an event into pending deliveries in the caller's unit of work (enqueue). The notifier
sends what is pending; the API and the planner enqueue their own events, and the API sends a
test delivery itself."""
