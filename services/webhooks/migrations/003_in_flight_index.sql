-- The deliveries under way (claimed, not yet recorded), by endpoint: a few rows, where the deliverer looks at each
-- turn for when each endpoint's next may go (store.due_endpoints), however long its backlog.
CREATE INDEX deliveries_in_flight ON deliveries (endpoint_id, in_flight_until)
    WHERE state = 'pending' AND in_flight_until IS NOT NULL;
