"""A store on a ClickHouse cluster: one job owns its schema, collectors only check it and write through it.

`stepline schema --cluster NAME --apply URL` (ClusterSchema.apply) creates and migrates the tables ON CLUSTER, waits
for every server to run each statement, then records the schema version. A collector whose store URL says
`?cluster=NAME` never creates or changes a table: it checks that the cluster holds its own schema version and
refuses to start otherwise (ClusterSchema.check), saying what to run. Before this, every sidecar created the schema on
first insert: on a cluster whose Distributed tables did not exist yet it made plain tables named like them on
whichever server answered, and the operator's later CREATE ... Distributed IF NOT EXISTS then did nothing there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from stepline.model import schema
from stepline.store.errors import StoreError, error_line
from stepline.store.migrations import Migration
from stepline.store.reads import scalar

log = logging.getLogger(__name__)

# An ON CLUSTER statement returns once every server ran it, or fails naming those that did not (`throw`); a server
# that does not answer within the timeout fails the job rather than leaving it half applied unseen.
# https://clickhouse.com/docs/operations/settings/settings#distributed_ddl_output_mode
# https://clickhouse.com/docs/operations/settings/settings#distributed_ddl_task_timeout
DDL_SETTINGS: dict[str, Any] = {"distributed_ddl_output_mode": "throw", "distributed_ddl_task_timeout": 600}


class ClusterSchema:
    """The schema of one database on one cluster, through a client on any of its servers.

    `rewrite` turns each statement into what the server runs: the identity on a real cluster; the test suite's
    clusters inside one chDB process (no Keeper, so no ON CLUSTER and no Replicated engines) pass their own.
    """

    def __init__(self, client: Client, database: str, cluster: str,
                 rewrite: Callable[[str], str] | None = None) -> None:
        self.client = client
        self.database = database
        self.cluster = cluster
        self._rewrite = rewrite or self.as_written
        self._migration = Migration(client, database)

    @staticmethod
    def as_written(statement: str) -> str:
        """What a server runs for `statement`: the statement itself."""
        return statement

    def servers(self) -> int:
        """How many servers the cluster has (replicas of all shards); StoreError if the server knows no such cluster."""
        count = int(scalar(self.client.query("SELECT count() FROM system.clusters WHERE cluster = {c:String}",
                                             parameters={"c": self.cluster})))
        if not count:
            raise StoreError(f"the server knows no cluster {self.cluster!r} (system.clusters): name one of its "
                             "remote_servers in the store URL's ?cluster=")
        return count

    def version(self) -> int | None:
        """The schema version the cluster holds; None when no `stepline schema --apply` made its tables."""
        tables = self._tables()
        if "schema_version" not in tables or any(tables.get(t.name) != "Distributed" for t in schema.TABLES):
            return None
        return self._migration.version()

    def check(self, store_name: str) -> int:
        """Refuse (StoreError, one line saying what to run) a cluster that does not hold this stepline's schema;
        the cluster's server count when it does."""
        servers = self.servers()
        job = f"stepline schema --cluster {self.cluster} --apply URL"
        try:
            found = self.version()
            wrong = self._other_cluster()
        except ClickHouseError as exc:
            raise StoreError(f"cannot read the schema of the cluster store {store_name}: {error_line(exc)}") from None
        if found is None:
            raise StoreError(f"the cluster store {store_name} has no stepline tables: run `{job}` first (collectors "
                             "never create tables on a cluster)")
        if wrong:
            raise StoreError(f"the cluster store {store_name}: {wrong}")
        if found > schema.SCHEMA_VERSION:
            raise StoreError(f"the cluster store {store_name} holds schema version {found}, newer than this "
                             f"stepline's {schema.SCHEMA_VERSION}: upgrade stepline")
        if found < schema.SCHEMA_VERSION:
            raise StoreError(f"the cluster store {store_name} holds schema version {found}, older than this "
                             f"stepline's {schema.SCHEMA_VERSION}: run `{job}` with this stepline first")
        return servers

    def apply(self, retention_days: int, store_name: str) -> list[str]:
        """Create or migrate the schema ON CLUSTER and record its version; the statements run, in order.

        Raises StoreError for a cluster of a newer schema, for a change this job does not make (a table whose engine
        or key changed: rebuild it by hand, see docs/deploy.md), or for a statement that fails on any server."""
        self.servers()
        run: list[str] = []
        statements = schema.ddl(self.database, retention_days, cluster=self.cluster)
        try:
            self._command(statements[0], run)
            self._command(statements[-1], run)  # schema_version first: refuse before touching tables
            found = self._migration.version()
            if found > schema.SCHEMA_VERSION:
                raise StoreError(f"the cluster store {store_name} holds schema version {found}, newer than this "
                                 f"stepline's {schema.SCHEMA_VERSION}: use a stepline of that version")
            tables = self._tables()
            wrong = [t for t in schema.TABLES if tables.get(t.name, "Distributed") != "Distributed"]
            if wrong:
                raise StoreError(f"the cluster store {store_name} holds {', '.join(t.name for t in wrong)} as "
                                 "plain tables, not Distributed ones (a collector made them before the schema job "
                                 "ran): move their rows and drop them first (docs/deploy.md)")
            outdated = self._migration.outdated_engines(suffix="_local")
            if outdated:
                raise StoreError(f"the cluster's {', '.join(t.name + '_local' for t in outdated)} are not today's "
                                 "engine or key: rebuild them by hand (docs/deploy.md), this job only adds")
            for statement in statements[1:-1]:
                self._command(statement, run)
            for table_name, column, after in self._migration.missing_columns_in_order():
                for name in (schema.local_name(table_name), table_name):
                    self._command(f"ALTER TABLE `{self.database}`.`{name}` ON CLUSTER `{self.cluster}` "
                                  f"ADD COLUMN IF NOT EXISTS {schema.column_sql(column)}{after}", run)
            for table, projection in self._migration.missing_projections(suffix="_local"):
                for statement in schema.add_projection_sql(self.database, table, projection,
                                                           name=schema.local_name(table.name), cluster=self.cluster):
                    self._command(statement, run)
            if found < schema.SCHEMA_VERSION:
                self.client.insert(f"`{self.database}`.`schema_version`",
                                   [[schema.SCHEMA_VERSION, round(time.time() * 1_000_000)]],
                                   column_names=["version", "applied_at"])
        except ClickHouseError as exc:
            raise StoreError(f"cannot apply the schema to the cluster store {store_name}: {error_line(exc)}") from None
        return run

    def _command(self, statement: str, run: list[str]) -> None:
        sql = self._rewrite(statement)
        self.client.command(sql, settings=DDL_SETTINGS if " ON CLUSTER " in sql else None)
        run.append(sql)

    def _tables(self) -> dict[str, str]:
        return {name: engine for name, (engine, _) in self._migration.layouts().items()}

    def _other_cluster(self) -> str:
        """What is wrong when the Distributed tables are over another cluster than the URL names ('' when not)."""
        for name, full in self.client.query(
                "SELECT name, engine_full FROM system.tables WHERE database = {db:String} AND engine = 'Distributed'",
                parameters={"db": self.database}).result_rows:
            if not str(full).startswith((f"Distributed('{self.cluster}'", f"Distributed(`{self.cluster}`")):
                return f"its table {name} is {str(full)[:80]}, not over the cluster {self.cluster!r} the URL names"
        return ""
