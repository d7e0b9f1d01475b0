"""What the timeline is: the typed rows sources yield (`rows`), the tables' DDL (`schema`) and the column reference
generated from it (`schemadoc`)."""
