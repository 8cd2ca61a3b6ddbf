"""One Prefect task per pipeline stage; each reads artifact refs and publishes one artifact."""
