// Runs @clickhouse/client against stepline's query endpoint and prints what it got as one JSON object.
// Usage: node queries.mjs URL DATABASE
import { createClient } from '@clickhouse/client'

const [url, database] = process.argv.slice(2)
const fresh = (extra = {}) => createClient({ url, database, request_timeout: 30000, ...extra })

async function attempt (fn) {
  try {
    return { ok: await fn() }
  } catch (err) {
    return { error: String(err && err.message), code: err && err.code }
  }
}

async function rows (client, query, format = 'JSONEachRow', settings = {}) {
  const rs = await client.query({ query, format, clickhouse_settings: settings })
  return rs.json()
}

const out = {}
const plain = fresh()
const gzipped = fresh({ compression: { response: true, request: true } })
const big = 'SELECT number, toString(number) AS s FROM numbers(200000)'

out.each_row = await attempt(async () => {
  const got = await rows(plain, big)
  return { rows: got.length, last: got[got.length - 1] }
})
out.json_document = await attempt(async () => {
  const doc = await rows(plain, big, 'JSON')
  return { rows: doc.rows, data: doc.data.length, meta: doc.meta.map(m => m.name) }
})
out.compressed = await attempt(async () => {
  const got = await rows(gzipped, big, 'JSONCompactEachRow')
  return { rows: got.length, last: got[got.length - 1] }
})
out.streamed = await attempt(async () => {
  const rs = await plain.query({ query: big, format: 'JSONEachRow' })
  let count = 0
  for await (const batch of rs.stream()) count += batch.length
  return { rows: count }
})
out.settings = await attempt(async () => rows(plain, "SELECT getSetting('max_threads') AS t, getSetting('readonly') AS r",
  'JSONEachRow', { max_threads: 3 }))
out.syntax_error = await attempt(async () => rows(plain, 'SELEC 1'))
out.write_refused = await attempt(async () => plain.command({ query: 'DROP TABLE steps' }))
// A query that fails after its first blocks, then a query on another connection: it must get its own rows only.
out.failed_mid_result = await attempt(async () => rows(plain, 'SELECT number, throwIf(number = 500000) FROM numbers(1000000)'))
out.after_failure = await attempt(async () => {
  const other = fresh()
  try {
    return await rows(other, 'SELECT count() AS n FROM numbers(10)')
  } finally {
    await other.close()
  }
})
out.tables = await attempt(async () => (await rows(plain, 'SHOW TABLES')).map(r => r.name))

await plain.close()
await gzipped.close()
console.log(JSON.stringify(out))
