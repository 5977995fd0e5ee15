// Fidelity checks of a 3-member MongoDB replica set (the changestream.testing simulator, or a
// real one with test commands enabled) through the official MongoDB Node.js driver, which
// nobody in this project wrote.
//
// Usage:
//   node fidelity.mjs [URI] [--only name,name] [--failover]
// URI defaults to $MONGODB_URI. One line per check ("ok <name>" / "FAIL <name>: <why>" /
// "skip <name>: <why>" for a check the server version does not support; "#" lines are
// comments), then exactly "N passed, N failed"; exit status 1 when anything failed.
// FIDELITY_DEBUG=1 also prints the commands and replies of the resume checks.
//
// The topology is read from hello: against mongos (msg "isdbgrid") the replica-set-only checks
// are skipped with their reason, the sharded checks run, and every other check goes through the
// URI's first mongos only (failpoints are per mongos, so they must be set where the stream runs);
// the sharded checks use every mongos the URI lists.
//
// --failover runs only the driven failover check (replica sets): it opens a change stream, prints
// "READY <db.coll> <resume token _data>", waits for one line on stdin
// "go <crash|stepdown> <new primary host:port> [_id inserted meanwhile]..." (the test steps the
// primary down, with or without closing its connections, and may insert documents), then
// writes more events and expects the same stream to deliver all of them exactly once.

import { createInterface } from 'node:readline';
import { isDeepStrictEqual } from 'node:util';

import { BSON, Binary, MongoClient, MongoServerError, ObjectId, Timestamp } from 'mongodb';

const { EJSON } = BSON;

const CHECK_TIMEOUT_MS = 30_000;
const AWAIT_MS = 200; // maxAwaitTimeMS of every stream: idle getMores return quickly
const NO_AUTH_UID = 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'; // sha256("")
const WIRE_VERSIONS = { '4.2': 8, '4.4': 9, '5.0': 13, '6.0': 17, '7.0': 21, '8.0': 25, '9.0': 29 };

// ------------------------------------------------------------------------------------------------
// small assertion helpers: every failure names what was expected and what came back

class CheckFailure extends Error {}

/** Thrown by a check that does not apply to this server version ("skip <name>: <why>"). */
class CheckSkipped extends Error {}

function show(value) {
  return value === undefined ? 'undefined (absent)' : EJSON.stringify(value, { relaxed: true });
}

function assert(cond, why) {
  if (!cond) throw new CheckFailure(why);
}

function same(actual, expected, what) {
  if (!isDeepStrictEqual(EJSON.serialize(actual), EJSON.serialize(expected))) {
    throw new CheckFailure(`${what}: expected ${show(expected)}, got ${show(actual)}`);
  }
}

function keysOf(doc, what, expected) {
  same(Object.keys(doc), expected, `${what} field order`);
}

function sleep(ms) {
  return new Promise(resolve => setTimeout(resolve, ms));
}

function uniqueName(prefix) {
  return `${prefix}_${new ObjectId().toHexString().slice(-8)}`;
}

// ------------------------------------------------------------------------------------------------
// resume-token helpers (server-notes §1: KeyString hex; version is the 2nd value)

function tokenVersion(token) {
  const data = token?._data;
  assert(typeof data === 'string' && /^[0-9A-F]+$/.test(data), `token _data is not upper-case hex: ${show(token)}`);
  assert(data.startsWith('82'), `token does not start with a Timestamp (82): ${data}`);
  const v = data.slice(18, 22);
  const versions = { '2B02': 1, '2B04': 2, '29': 0 };
  if (v.startsWith('29')) return 0;
  assert(v in versions, `cannot read the token version from ${data}`);
  return versions[v];
}

function isHighWaterMark(token) {
  // clusterTime, version, tokenType 0 (29), txnOpIndex 0 (29), fromInvalidate false (6E), [v2: null uuid 14], end
  const data = token._data;
  const rest = data.slice(22);
  return tokenVersion(token) === 2 ? rest === '29296E1404' : rest === '29296E04';
}

function expectedTokenVersion(serverVersion) {
  const [major, minor] = serverVersion.split('.').map(Number);
  return major > 6 || (major === 6 && minor >= 1) ? 2 : 1;
}

// ------------------------------------------------------------------------------------------------
// command monitoring: every command the driver sends and every reply it gets

class CommandLog {
  constructor(client) {
    this.events = [];
    this.heartbeats = [];
    for (const kind of ['commandStarted', 'commandSucceeded', 'commandFailed']) {
      client.on(kind, event => this.events.push({ kind, event }));
    }
    for (const kind of ['serverHeartbeatSucceeded', 'serverHeartbeatFailed']) {
      client.on(kind, event => this.heartbeats.push({ kind, event }));
    }
  }

  mark() {
    return this.events.length;
  }

  since(mark, kind, name) {
    return this.events
      .slice(mark)
      .filter(e => e.kind === kind && e.event.commandName === name)
      .map(e => e.event);
  }
}

// ------------------------------------------------------------------------------------------------
// change-stream helpers

/** Open `cs` (the Node driver sends the aggregate lazily): first tryNext must be empty. */
async function open(cs) {
  const first = await cs.tryNext();
  assert(first === null, `a new stream returned an event before anything was written: ${show(first)}`);
  return cs;
}

/** Next event within `ms`, polling tryNext (each poll is one getMore waiting maxAwaitTimeMS). */
async function nextEvent(cs, ms = 5000) {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    const change = await cs.tryNext();
    if (change !== null) return change;
  }
  return null;
}

async function collect(cs, n, ms = 8000) {
  const events = [];
  const deadline = Date.now() + ms;
  while (events.length < n && Date.now() < deadline) {
    const change = await cs.tryNext();
    if (change !== null) events.push(change);
  }
  assert(events.length === n, `expected ${n} events, got ${events.length}: ${show(events.map(e => e.operationType))}`);
  return events;
}

/** After `collect`, nothing more may arrive (no duplicate after a resume). */
async function expectQuiet(cs, what) {
  const extra = await cs.tryNext();
  assert(extra === null, `${what}: unexpected extra event ${show(extra)}`);
  const again = await cs.tryNext();
  assert(again === null, `${what}: unexpected extra event ${show(again)}`);
}

function assertIncreasingTokens(events, what) {
  for (let i = 1; i < events.length; i++) {
    assert(events[i]._id._data > events[i - 1]._id._data,
      `${what}: resume tokens not increasing: ${events[i - 1]._id._data} then ${events[i]._id._data}`);
  }
}

async function withFailPoint(client, name, mode, data, body) {
  const admin = client.db('admin');
  await admin.command({ configureFailPoint: name, mode, data });
  try {
    return await body();
  } finally {
    await admin.command({ configureFailPoint: name, mode: 'off' });
  }
}

async function expectServerError(promise, code, what) {
  try {
    const value = await promise;
    throw new CheckFailure(`${what}: expected server error ${code}, got ${show(value)}`);
  } catch (err) {
    if (err instanceof CheckFailure) throw err;
    assert(err instanceof MongoServerError, `${what}: expected a server error ${code}, got ${err?.name}: ${err?.message}`);
    assert(err.code === code, `${what}: expected code ${code}, got ${err.code} (${err.message})`);
    return err;
  }
}

// ------------------------------------------------------------------------------------------------
// the checks; each gets { client, log, db, info } with a fresh database

const checks = {};

checks.topology = async ({ client, log, info }) => {
  const hello = await client.db('admin').command({ hello: 1 });
  assert(hello.isWritablePrimary === true, `hello.isWritablePrimary: ${hello.isWritablePrimary}`);
  assert(hello.secondary === false, `hello.secondary: ${hello.secondary}`);
  assert(typeof hello.setName === 'string' && hello.setName.length > 0, `hello.setName: ${hello.setName}`);
  assert(Array.isArray(hello.hosts) && hello.hosts.length === 3, `hello.hosts should list 3 members: ${show(hello.hosts)}`);
  assert(hello.primary === hello.me, `hello.primary ${hello.primary} != hello.me ${hello.me}`);
  assert(hello.hosts.includes(hello.me), `hello.me ${hello.me} not in hosts`);
  assert(hello.electionId instanceof ObjectId, `hello.electionId is not an ObjectId: ${show(hello.electionId)}`);
  assert(hello.topologyVersion?.processId instanceof ObjectId, `hello.topologyVersion: ${show(hello.topologyVersion)}`);
  assert(hello.lastWrite?.opTime?.ts instanceof Timestamp, `hello.lastWrite.opTime.ts: ${show(hello.lastWrite)}`);
  same([hello.maxBsonObjectSize, hello.maxMessageSizeBytes, hello.maxWriteBatchSize],
    [16777216, 48000000, 100000], 'hello size limits');
  same(hello.logicalSessionTimeoutMinutes, 30, 'hello.logicalSessionTimeoutMinutes');
  same(hello.minWireVersion, 0, 'hello.minWireVersion');
  const expectedWire = WIRE_VERSIONS[info.majorMinor];
  if (expectedWire !== undefined) same(hello.maxWireVersion, expectedWire, `hello.maxWireVersion for ${info.version}`);
  assert(hello.operationTime instanceof Timestamp, `hello reply lacks operationTime: ${show(hello.operationTime)}`);
  assert(hello.$clusterTime?.clusterTime instanceof Timestamp, `hello reply lacks $clusterTime`);

  // the driver's own view: SDAM must discover one primary and two secondaries
  const deadline = Date.now() + 10_000;
  let description;
  for (;;) {
    description = client.topology?.description;
    const types = [...(description?.servers?.values() ?? [])].map(s => s.type).sort();
    if (description?.type === 'ReplicaSetWithPrimary' && show(types) === show(['RSPrimary', 'RSSecondary', 'RSSecondary'])) break;
    if (Date.now() > deadline) {
      throw new CheckFailure(`driver topology after 10 s: ${description?.type} ${show(types)}`);
    }
    await sleep(100);
  }
  same(description.setName, hello.setName, 'topology setName');

  // hello replies carry topologyVersion, so the driver's monitors switch to the streaming
  // (awaitable, exhaust) protocol; with heartbeatFrequencyMS 500 awaited replies keep coming
  const awaitedBy = Date.now() + 5000;
  const awaitedHosts = () => new Set(log.heartbeats.filter(h => h.kind === 'serverHeartbeatSucceeded' && h.event.awaited).map(h => h.event.connectionId));
  while (awaitedHosts().size < 3 && Date.now() < awaitedBy) await sleep(100);
  assert(awaitedHosts().size === 3, `awaited (streaming) hello heartbeats succeeded only for ${show([...awaitedHosts()])}; failed: ${show(log.heartbeats.filter(h => h.kind === 'serverHeartbeatFailed').map(h => h.event.failure?.message))}`);

  // each secondary answers hello as a secondary when connected directly
  for (const host of hello.hosts.filter(h => h !== hello.primary)) {
    const direct = new MongoClient(`mongodb://${host}/?directConnection=true`, { serverSelectionTimeoutMS: 5000 });
    try {
      const h = await direct.db('admin').command({ hello: 1 });
      assert(h.isWritablePrimary === false && h.secondary === true, `${host} hello: isWritablePrimary=${h.isWritablePrimary} secondary=${h.secondary}`);
      same(h.primary, hello.primary, `${host} hello.primary`);
      same(h.setName, hello.setName, `${host} hello.setName`);
    } finally {
      await direct.close();
    }
  }
};

checks.crud = async ({ db }) => {
  const coll = db.collection('crud');
  const ins = await coll.insertOne({ _id: 1, name: 'a', n: 1, tags: ['x'] });
  same(ins.insertedId, 1, 'insertOne insertedId');
  const many = await coll.insertMany([{ _id: 2, name: 'b', n: 2 }, { _id: 3, name: 'c', n: 3 }]);
  same(many.insertedCount, 2, 'insertMany insertedCount');
  same(await coll.findOne({ _id: 1 }), { _id: 1, name: 'a', n: 1, tags: ['x'] }, 'findOne');
  const upd = await coll.updateOne({ _id: 2 }, { $inc: { n: 10 }, $push: { tags: 'y' } });
  same([upd.matchedCount, upd.modifiedCount], [1, 1], 'updateOne matched/modified');
  const rep = await coll.replaceOne({ _id: 3 }, { name: 'c2' });
  same([rep.matchedCount, rep.modifiedCount], [1, 1], 'replaceOne matched/modified');
  const ups = await coll.updateOne({ _id: 4 }, { $set: { name: 'd' } }, { upsert: true });
  same(ups.upsertedId, 4, 'upsert upsertedId');
  const fam = await coll.findOneAndUpdate({ _id: 1 }, { $set: { n: 5 } }, { returnDocument: 'after' });
  same(fam, { _id: 1, name: 'a', n: 5, tags: ['x'] }, 'findOneAndUpdate returnDocument after');
  same(await coll.find({}, { sort: { _id: -1 }, projection: { name: 1 } }).toArray(),
    [{ _id: 4, name: 'd' }, { _id: 3, name: 'c2' }, { _id: 2, name: 'b' }, { _id: 1, name: 'a' }], 'find sort/projection');
  same(await coll.find({ n: { $gte: 5 } }).batchSize(1).toArray(),
    [{ _id: 1, name: 'a', n: 5, tags: ['x'] }, { _id: 2, name: 'b', n: 12, tags: ['y'] }], 'find with getMore (batchSize 1)');
  same(await coll.countDocuments({}), 4, 'countDocuments');
  same(await coll.aggregate([{ $group: { _id: null, total: { $sum: '$n' } } }]).toArray(), [{ _id: null, total: 17 }], 'aggregate $group');
  const del = await coll.deleteMany({ _id: { $in: [3, 4] } });
  same(del.deletedCount, 2, 'deleteMany deletedCount');
  const dup = await expectServerError(coll.insertOne({ _id: 1 }), 11000, 'duplicate _id insert');
  assert(/duplicate key/.test(dup.message), `duplicate-key message: ${dup.message}`);
};

checks.collection_watch_events = async ({ client, log, db, info }) => {
  await db.createCollection('c');
  const coll = db.collection('c');
  const mark = log.mark();
  const cs = await open(coll.watch([], { fullDocument: 'updateLookup', maxAwaitTimeMS: AWAIT_MS }));
  try {
    const agg = log.since(mark, 'commandStarted', 'aggregate')[0].command;
    same(agg.pipeline, [{ $changeStream: { fullDocument: 'updateLookup' } }], 'aggregate pipeline sent by the driver');
    const aggReply = log.since(mark, 'commandSucceeded', 'aggregate')[0].reply;
    same(aggReply.cursor.ns, `${db.databaseName}.c`, 'aggregate reply cursor.ns');
    assert(aggReply.cursor.postBatchResumeToken?._data, `aggregate reply lacks postBatchResumeToken: ${show(aggReply.cursor)}`);
    same(Object.keys(aggReply.cursor), ['firstBatch', 'postBatchResumeToken', 'id', 'ns'], 'aggregate reply cursor field order');

    const insMark = log.mark();
    await coll.insertOne({ _id: 1, a: 1, b: 2, arr: ['foo', { a: 'bar' }, 1, 2, 3] });
    const insertReply = log.since(insMark, 'commandSucceeded', 'insert')[0].reply;
    const ins = await nextEvent(cs);
    assert(ins, 'no insert event');
    keysOf(ins, 'insert', ['_id', 'operationType', 'clusterTime', 'wallTime', 'fullDocument', 'ns', 'documentKey']);
    same(ins.operationType, 'insert', 'insert operationType');
    same(ins.ns, { db: db.databaseName, coll: 'c' }, 'insert ns');
    same(ins.documentKey, { _id: 1 }, 'insert documentKey');
    same(ins.fullDocument, { _id: 1, a: 1, b: 2, arr: ['foo', { a: 'bar' }, 1, 2, 3] }, 'insert fullDocument');
    assert(ins.clusterTime instanceof Timestamp, `clusterTime is not a Timestamp: ${show(ins.clusterTime)}`);
    assert(ins.wallTime instanceof Date, `wallTime is not a Date: ${show(ins.wallTime)}`);
    same(ins.clusterTime, insertReply.operationTime, "insert event clusterTime = the insert reply's operationTime");
    same(tokenVersion(ins._id), expectedTokenVersion(info.version), `resume token version for server ${info.version}`);
    same(Object.keys(ins._id), ['_data'], 'resume token fields for an int32 _id (no _typeBits)');

    await coll.updateOne({ _id: 1 }, { $set: { a: 2 }, $unset: { b: '' } });
    const upd = await nextEvent(cs);
    assert(upd, 'no update event');
    keysOf(upd, 'update', ['_id', 'operationType', 'clusterTime', 'wallTime', 'fullDocument', 'ns', 'documentKey', 'updateDescription']);
    same(upd.updateDescription, { updatedFields: { a: 2 }, removedFields: ['b'], truncatedArrays: [] }, 'update updateDescription');
    same(upd.fullDocument, { _id: 1, a: 2, arr: ['foo', { a: 'bar' }, 1, 2, 3] }, 'update fullDocument (updateLookup)');
    same(upd.documentKey, { _id: 1 }, 'update documentKey');

    // the spec's "array truncation" case: a pipeline update that shortens an array
    await coll.updateOne({ _id: 1 }, [{ $set: { arr: ['foo', { a: 'bar' }] } }]);
    const trunc = await nextEvent(cs);
    assert(trunc, 'no update event for the array truncation');
    same(trunc.operationType, 'update', 'truncation operationType');
    same(trunc.updateDescription, { updatedFields: {}, removedFields: [], truncatedArrays: [{ field: 'arr', newSize: 2 }] }, 'truncation updateDescription');

    await coll.updateOne({ _id: 1 }, { $push: { arr: 'baz' } });
    const push = await nextEvent(cs);
    same(push?.updateDescription, { updatedFields: { 'arr.2': 'baz' }, removedFields: [], truncatedArrays: [] }, '$push updateDescription');

    await coll.replaceOne({ _id: 1 }, { x: 1 });
    await coll.deleteOne({ _id: 1 });
    const [rep, del] = await collect(cs, 2);
    keysOf(rep, 'replace', ['_id', 'operationType', 'clusterTime', 'wallTime', 'fullDocument', 'ns', 'documentKey']);
    same([rep.operationType, rep.fullDocument, rep.documentKey], ['replace', { _id: 1, x: 1 }, { _id: 1 }], 'replace event');
    keysOf(del, 'delete', ['_id', 'operationType', 'clusterTime', 'wallTime', 'ns', 'documentKey']);
    same([del.operationType, del.documentKey, del.ns], ['delete', { _id: 1 }, { db: db.databaseName, coll: 'c' }], 'delete event');

    // updateLookup reads the current document: gone by the time the update is read -> null
    await coll.insertOne({ _id: 2, v: 1 });
    await coll.updateOne({ _id: 2 }, { $set: { v: 2 } });
    await coll.deleteOne({ _id: 2 });
    const [, lateUpd] = await collect(cs, 3);
    same([lateUpd.operationType, lateUpd.fullDocument], ['update', null], 'updateLookup of a deleted document');
    // a no-op update writes no oplog entry, so no event
    await coll.insertOne({ _id: 3, v: 1 });
    await coll.updateOne({ _id: 3 }, { $set: { v: 1 } });
    await coll.insertOne({ _id: 4 });
    const quiet = await collect(cs, 2);
    same(quiet.map(e => [e.operationType, e.documentKey._id]), [['insert', 3], ['insert', 4]], 'no event for an update that changes nothing');
    assertIncreasingTokens([ins, upd, trunc, push, rep, del, ...quiet], 'collection stream');

    const getMores = log.since(mark, 'commandStarted', 'getMore').map(e => e.command);
    assert(getMores.length > 0, 'no getMore was sent');
    same(getMores[0].collection, 'c', 'getMore collection');
    same(Number(getMores[0].maxTimeMS), AWAIT_MS, 'getMore maxTimeMS (= maxAwaitTimeMS)');
  } finally {
    await cs.close();
  }
};

checks.db_watch = async ({ log, db }) => {
  const c1 = db.collection('one');
  const c2 = db.collection('two');
  await c1.insertOne({ _id: 0 });
  const mark = log.mark();
  const cs = await open(db.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  try {
    same(log.since(mark, 'commandStarted', 'aggregate')[0].command.aggregate, 1, 'db.watch aggregate target');
    same(log.since(mark, 'commandSucceeded', 'aggregate')[0].reply.cursor.ns, `${db.databaseName}.$cmd.aggregate`, 'db stream cursor.ns');
    await c1.insertOne({ _id: 1 });
    await c2.insertOne({ _id: 2 });
    await c1.drop();
    await c2.insertOne({ _id: 3 });
    const events = await collect(cs, 4);
    same(events.map(e => [e.operationType, e.ns.coll]), [['insert', 'one'], ['insert', 'two'], ['drop', 'one'], ['insert', 'two']],
      'db stream events (a drop does not invalidate a db stream)');
    keysOf(events[2], 'drop', ['_id', 'operationType', 'clusterTime', 'wallTime', 'ns']);
    assert(!cs.closed, 'db stream closed after a collection drop');
    same(log.since(mark, 'commandStarted', 'getMore')[0].command.collection, '$cmd.aggregate', 'db stream getMore collection');
    assertIncreasingTokens(events, 'db stream');
  } finally {
    await cs.close();
  }
};

checks.client_watch = async ({ client, log, db }) => {
  const other = client.db(uniqueName('nodefid_other'));
  const mark = log.mark();
  const cs = await open(client.watch([{ $match: { 'ns.db': { $in: [db.databaseName, other.databaseName] } } }], { maxAwaitTimeMS: AWAIT_MS }));
  try {
    const agg = log.since(mark, 'commandStarted', 'aggregate')[0];
    same([agg.databaseName, agg.command.aggregate, agg.command.pipeline[0]],
      ['admin', 1, { $changeStream: { allChangesForCluster: true } }], 'client.watch aggregate');
    same(log.since(mark, 'commandSucceeded', 'aggregate')[0].reply.cursor.ns, 'admin.$cmd.aggregate', 'cluster stream cursor.ns');
    await db.collection('a').insertOne({ _id: 1 });
    await other.collection('b').insertOne({ _id: 2 });
    await other.dropDatabase();
    await db.collection('a').insertOne({ _id: 3 });
    const events = await collect(cs, 5);
    same(events.map(e => [e.operationType, e.ns]), [
      ['insert', { db: db.databaseName, coll: 'a' }],
      ['insert', { db: other.databaseName, coll: 'b' }],
      ['drop', { db: other.databaseName, coll: 'b' }],
      ['dropDatabase', { db: other.databaseName }],
      ['insert', { db: db.databaseName, coll: 'a' }],
    ], 'cluster stream events (never invalidated)');
    keysOf(events[3], 'dropDatabase', ['_id', 'operationType', 'clusterTime', 'wallTime', 'ns']);
    same(log.since(mark, 'commandStarted', 'getMore')[0].command.collection, '$cmd.aggregate', 'cluster stream getMore collection');
  } finally {
    await cs.close();
    await other.dropDatabase();
  }
};

checks.resume_after = async ({ log, db }) => {
  const coll = db.collection('r');
  await db.createCollection('r');
  const cs1 = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  let first;
  try {
    await coll.insertMany([{ _id: 1 }, { _id: 2 }]);
    first = await collect(cs1, 2);
  } finally {
    await cs1.close();
  }
  await coll.insertOne({ _id: 3 });
  const mark = log.mark();
  const cs2 = coll.watch([], { resumeAfter: first[0]._id, maxAwaitTimeMS: AWAIT_MS });
  try {
    const resumed = await collect(cs2, 2);
    same(resumed.map(e => e.documentKey._id), [2, 3], 'events after resumeAfter <token of insert 1>');
    same(resumed[0]._id, first[1]._id, 'a replayed event has the same resume token');
    await expectQuiet(cs2, 'resumeAfter');
    same(log.since(mark, 'commandStarted', 'aggregate')[0].command.pipeline[0].$changeStream.resumeAfter, first[0]._id, 'resumeAfter sent');
  } finally {
    await cs2.close();
  }
  // startAtOperationTime is inclusive
  const cs3 = coll.watch([], { startAtOperationTime: first[1].clusterTime, maxAwaitTimeMS: AWAIT_MS });
  try {
    same((await collect(cs3, 2)).map(e => e.documentKey._id), [2, 3], 'events from startAtOperationTime <clusterTime of insert 2>');
    await expectQuiet(cs3, 'startAtOperationTime');
  } finally {
    await cs3.close();
  }
};

checks.start_after_invalidate = async ({ log, db, info }) => {
  const coll = db.collection('inv');
  await coll.insertOne({ _id: 0 });
  const mark = log.mark();
  const cs = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  let invalidate;
  try {
    await coll.insertOne({ _id: 1 });
    await coll.drop();
    const events = await collect(cs, 3);
    same(events.map(e => e.operationType), ['insert', 'drop', 'invalidate'], 'events of a dropped collection');
    invalidate = events[2];
    keysOf(invalidate, 'invalidate', ['_id', 'operationType', 'clusterTime', 'wallTime']);
    keysOf(events[1], 'drop', ['_id', 'operationType', 'clusterTime', 'wallTime', 'ns']);
    same(invalidate.clusterTime, events[1].clusterTime, 'invalidate clusterTime = drop clusterTime');
    assert(invalidate._id._data > events[1]._id._data, 'invalidate token must sort after the drop token (fromInvalidate)');
    const last = log.since(mark, 'commandSucceeded', 'getMore').map(e => e.reply.cursor).find(c => c.nextBatch.some(d => d.operationType === 'invalidate'));
    assert(last, 'no getMore reply carried the invalidate');
    same(Number(last.id), 0, 'cursor id after invalidate');
    same(last.postBatchResumeToken, invalidate._id, 'postBatchResumeToken after invalidate');
  } finally {
    await cs.close();
  }
  // resumeAfter an invalidate is refused (260); startAfter is allowed
  const bad = coll.watch([], { resumeAfter: invalidate._id });
  try {
    await expectServerError(bad.tryNext(), 260, 'resumeAfter an invalidate token');
  } finally {
    await bad.close();
  }
  const cs2 = coll.watch([], { startAfter: invalidate._id, maxAwaitTimeMS: AWAIT_MS });
  try {
    const first = await cs2.tryNext();
    assert(first === null, `startAfter the invalidate replayed something: ${show(first)}`);
    if (info.topology === 'replicaset') {
      same(cs2.resumeToken, invalidate._id, 'resumeToken right after startAfter');
    } else {
      // mongos's idle getMores advance its postBatchResumeToken (shards' periodic no-ops)
      assert(cs2.resumeToken?._data >= invalidate._id._data,
        `resumeToken right after startAfter ${show(cs2.resumeToken)} sorts before the invalidate ${invalidate._id._data}`);
    }
    await coll.insertOne({ _id: 2 });
    const ev = await nextEvent(cs2);
    same([ev?.operationType, ev?.documentKey], ['insert', { _id: 2 }], 'event of the re-created collection after startAfter');
  } finally {
    await cs2.close();
  }
};

checks.expanded_events = async ({ db, info }) => {
  await db.createCollection('target');
  const targetInfo = (await db.listCollections({ name: 'target' }).toArray())[0];
  const cs = await open(db.watch([], { showExpandedEvents: true, maxAwaitTimeMS: AWAIT_MS }));
  try {
    await db.createCollection('ddl');
    const ddl = db.collection('ddl');
    await ddl.createIndex({ x: 1 }, { name: 'x_1' });
    await db.command({ collMod: 'ddl', index: { name: 'x_1', hidden: true } });
    await ddl.dropIndex('x_1');
    await ddl.rename('target', { dropTarget: true });
    const events = await collect(cs, 5);
    const ns = { db: db.databaseName, coll: 'ddl' };
    same(events.map(e => e.operationType), ['create', 'createIndexes', 'modify', 'dropIndexes', 'rename'], 'expanded event types');
    const [create, ci, modify, di, rename] = events;
    const uuid = create.collectionUUID;
    assert(uuid instanceof Binary && uuid.sub_type === 4, `collectionUUID is not a UUID: ${show(uuid)}`);
    for (const e of events) {
      same(e.collectionUUID, uuid, `${e.operationType} collectionUUID`);
      same(e.ns, ns, `${e.operationType} ns`);
    }
    // nsType on create events from 8.1 (showExpandedEvents), after every other field
    const [vMajor, vMinor] = info.versionArray;
    const hasNsType = vMajor > 8 || (vMajor === 8 && vMinor >= 1);
    keysOf(create, 'create', ['_id', 'operationType', 'clusterTime', 'collectionUUID', 'wallTime', 'ns', 'operationDescription',
      ...(hasNsType ? ['nsType'] : [])]);
    if (hasNsType) same(create.nsType, 'collection', 'create nsType');
    same(create.operationDescription.idIndex, { v: 2, key: { _id: 1 }, name: '_id_' }, 'create operationDescription.idIndex');
    keysOf(ci, 'createIndexes', ['_id', 'operationType', 'clusterTime', 'collectionUUID', 'wallTime', 'ns', 'operationDescription']);
    same(ci.operationDescription, { indexes: [{ v: 2, key: { x: 1 }, name: 'x_1' }] }, 'createIndexes operationDescription');
    keysOf(modify, 'modify', ['_id', 'operationType', 'clusterTime', 'collectionUUID', 'wallTime', 'ns', 'operationDescription', 'stateBeforeChange']);
    same(modify.operationDescription, { index: { name: 'x_1', hidden: true } }, 'modify operationDescription');
    same(modify.stateBeforeChange, { collectionOptions: { uuid }, indexOptions: { hidden: false } }, 'modify stateBeforeChange');
    // the dropped spec is the catalog's current one, so it carries the collMod'ed hidden flag
    same(di.operationDescription, { indexes: [{ v: 2, key: { x: 1 }, name: 'x_1', hidden: true }] }, 'dropIndexes operationDescription');
    keysOf(rename, 'rename', ['to', '_id', 'operationType', 'clusterTime', 'collectionUUID', 'wallTime', 'ns', 'operationDescription']);
    same(rename.to, { db: db.databaseName, coll: 'target' }, 'rename to');
    same(rename.operationDescription, { to: { db: db.databaseName, coll: 'target' }, dropTarget: targetInfo.info.uuid }, 'rename operationDescription');
    assertIncreasingTokens(events, 'expanded events');
    // an insert into a missing collection creates it: create then insert; updates carry
    // disambiguatedPaths with showExpandedEvents on 6.1+
    await db.collection('implicit').insertOne({ _id: 1, a: {} });
    await db.collection('implicit').updateOne({ _id: 1 }, { $set: { 'a.0': 1, b: 2 } });
    const [icreate, iins, iupd] = await collect(cs, 3);
    same([icreate.operationType, iins.operationType, iupd.operationType], ['create', 'insert', 'update'], 'implicit creation events');
    same(icreate.collectionUUID, iins.collectionUUID, 'implicit create/insert collectionUUID');
    keysOf(iins, 'expanded insert', ['_id', 'operationType', 'clusterTime', 'collectionUUID', 'wallTime', 'fullDocument', 'ns', 'documentKey']);
    const expectedDesc = { updatedFields: { 'a.0': 1, b: 2 }, removedFields: [], truncatedArrays: [] };
    if (expectedTokenVersion(info.version) === 2) expectedDesc.disambiguatedPaths = { 'a.0': ['a', '0'] };
    same(iupd.updateDescription, expectedDesc, `expanded update updateDescription on ${info.version}`);
    // without showExpandedEvents, create and createIndexes are invisible
    const plain = await open(db.watch([], { maxAwaitTimeMS: AWAIT_MS }));
    try {
      await db.createCollection('ddl2');
      await db.collection('ddl2').createIndex({ y: 1 });
      await db.collection('ddl2').insertOne({ _id: 1 });
      const ev = await nextEvent(plain);
      same([ev?.operationType, ev?.ns?.coll], ['insert', 'ddl2'], 'first classic event after create/createIndexes');
    } finally {
      await plain.close();
    }
  } finally {
    await cs.close();
  }
};

checks.idle_try_next_pbrt = async ({ log, db }) => {
  const coll = db.collection('idle');
  await db.createCollection('idle');
  const mark = log.mark();
  const cs = await open(coll.watch([], { maxAwaitTimeMS: 300 }));
  try {
    const t0 = cs.resumeToken;
    assert(t0?._data, `no resumeToken after the initial aggregate: ${show(t0)}`);
    assert(isHighWaterMark(t0), `initial postBatchResumeToken is not a high-water mark: ${t0._data}`);
    const started = Date.now();
    assert((await cs.tryNext()) === null, 'idle tryNext returned an event');
    const waited = Date.now() - started;
    assert(waited >= 250, `idle getMore returned after ${waited} ms; maxAwaitTimeMS was 300`);
    assert(waited < 3000, `idle getMore took ${waited} ms; maxAwaitTimeMS was 300`);
    const t1 = cs.resumeToken;
    assert(t1._data >= t0._data, `resumeToken went backwards: ${t0._data} -> ${t1._data}`);
    // a write elsewhere advances the scanned oplog time -> PBRT moves on an empty batch
    await db.collection('elsewhere').insertOne({ _id: 1 });
    assert((await cs.tryNext()) === null, 'tryNext returned an event for another collection');
    const t2 = cs.resumeToken;
    assert(t2._data > t1._data, `resumeToken did not advance across an empty batch after an unrelated write: ${t1._data} -> ${t2._data}`);
    assert(isHighWaterMark(t2), `postBatchResumeToken after an empty batch is not a high-water mark: ${t2._data}`);
    const replies = log.since(mark, 'commandSucceeded', 'getMore').map(e => e.reply.cursor);
    assert(replies.every(c => c.nextBatch.length === 0 && c.postBatchResumeToken?._data), `idle getMore replies: ${show(replies)}`);
    same(replies.at(-1).postBatchResumeToken, t2, 'resumeToken = last postBatchResumeToken');
    await coll.insertOne({ _id: 1 });
    const ev = await nextEvent(cs);
    assert(ev && ev._id._data > t2._data, `event after the idle period: ${show(ev)}`);
    same(cs.resumeToken, ev._id, 'resumeToken after the event');
    // a stream resumed from a high-water mark delivers what came after it
    const cs2 = coll.watch([], { resumeAfter: t2, maxAwaitTimeMS: AWAIT_MS });
    try {
      const again = await nextEvent(cs2);
      same(again?._id, ev._id, 'resumeAfter a high-water-mark token');
    } finally {
      await cs2.close();
    }
  } finally {
    await cs.close();
  }
};

async function resumeScenario({ client, log, db }, name, mode, data, inspect) {
  const coll = db.collection(name);
  await db.createCollection(name);
  const cs = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  try {
    await coll.insertOne({ _id: 1 });
    const e1 = await nextEvent(cs);
    assert(e1?.documentKey?._id === 1, `first event: ${show(e1)}`);
    const mark = log.mark();
    await withFailPoint(client, mode, { times: 1 }, data, async () => {
      await coll.insertMany([{ _id: 2 }, { _id: 3 }]);
      const events = await collect(cs, 2, 15_000);
      same(events.map(e => e.documentKey._id), [2, 3], 'events across the resume');
    });
    await coll.insertOne({ _id: 4 });
    same((await nextEvent(cs))?.documentKey, { _id: 4 }, 'event after the resume');
    await expectQuiet(cs, 'after the resume');
    const aggs = log.since(mark, 'commandStarted', 'aggregate');
    same(aggs.length, 1, 'resume aggregates sent');
    same(aggs[0].command.pipeline[0].$changeStream.resumeAfter, e1._id, 'resume aggregate resumeAfter');
    if (inspect) inspect(log, mark);
    if (process.env.FIDELITY_DEBUG) console.log('#', show(log.events.slice(mark).map(e => [e.kind, e.event.commandName, e.event.reply ?? e.event.failure?.message ?? ''])));
  } finally {
    await cs.close();
  }
}

checks.resume_network_error = ctx => resumeScenario(ctx, 'net', 'failCommand',
  { failCommands: ['getMore'], closeConnection: true });

checks.resume_labelled_error = ctx => resumeScenario(ctx, 'lbl', 'failGetMoreAfterCursorCheckout',
  { errorCode: 6 }, (log, mark) => {
    const failed = log.since(mark, 'commandFailed', 'getMore');
    same(failed.length, 1, 'failed getMores');
    const err = failed[0].failure;
    same(err.code, 6, 'getMore error code');
    assert(err.errorLabels?.includes('ResumableChangeStreamError'),
      `getMore error lacks the ResumableChangeStreamError label: ${show(err.errorLabels)} (${err.message})`);
    same(err.message, "Hit the 'failGetMoreAfterCursorCheckout' failpoint", 'getMore error message');
    // the failed getMore deleted the server cursor: the driver's killCursors finds nothing
    const kills = log.since(mark, 'commandSucceeded', 'killCursors').map(e => e.reply);
    same(kills.length, 1, 'killCursors sent by the driver before resuming');
    assert(kills[0].cursorsNotFound?.length === 1 && kills[0].cursorsKilled?.length === 0,
      `killCursors after failGetMoreAfterCursorCheckout: ${show(kills[0])} (mongod deletes the cursor on any getMore error)`);
  });

checks.no_resume_without_label = async ({ client, log, db }) => {
  const coll = db.collection('nolabel');
  await db.createCollection('nolabel');
  const cs = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  try {
    const mark = log.mark();
    await withFailPoint(client, 'failCommand', { times: 1 }, { failCommands: ['getMore'], errorCode: 6, closeConnection: false }, async () => {
      await coll.insertOne({ _id: 1 });
      const err = await expectServerError(nextEvent(cs), 6, 'getMore failing with code 6 and no label');
      assert(!err.errorLabels?.includes('ResumableChangeStreamError'), `failCommand error carries labels: ${show(err.errorLabels)}`);
      same(err.message, "Failing command via 'failCommand' failpoint", 'failCommand error message');
    });
    same(log.since(mark, 'commandStarted', 'aggregate').length, 0, 'aggregates after a non-resumable error');
    assert(cs.closed, 'the stream is still open after a non-resumable error');
  } finally {
    await cs.close();
  }
};

checks.transaction_events = async ({ client, db }) => {
  await db.createCollection('t1');
  await db.createCollection('t2');
  const cs = await open(db.watch([], { maxAwaitTimeMS: AWAIT_MS, promoteLongs: false }));
  const session = client.startSession();
  try {
    await session.withTransaction(async () => {
      await db.collection('t1').insertOne({ _id: 1 }, { session });
      await db.collection('t2').insertOne({ _id: 2 }, { session });
      await db.collection('t1').updateOne({ _id: 1 }, { $set: { x: 1 } }, { session });
    });
    await db.collection('t1').insertOne({ _id: 3 });
    const events = await collect(cs, 4);
    same(events.map(e => [e.operationType, e.ns.coll]), [['insert', 't1'], ['insert', 't2'], ['update', 't1'], ['insert', 't1']], 'events of a transaction then a plain insert');
    const txn = events.slice(0, 3);
    const lsidId = session.id.id;
    for (const e of txn) {
      keysOf(e, `transaction ${e.operationType}`, ['txnNumber', 'lsid', '_id', 'operationType', 'clusterTime', 'wallTime',
        ...(e.operationType === 'insert' ? ['fullDocument'] : []), 'ns', 'documentKey', ...(e.operationType === 'update' ? ['updateDescription'] : [])]);
      assert(e.txnNumber?._bsontype === 'Long', `txnNumber is not an Int64: ${show(e.txnNumber)}`);
      same(Number(e.txnNumber), Number(session.serverSession.txnNumber), 'txnNumber');
      same(Object.keys(e.lsid), ['id', 'uid'], 'lsid fields');
      same(e.lsid.id, lsidId, 'lsid.id = the session id');
      same(Buffer.from(e.lsid.uid.buffer).toString('hex'), NO_AUTH_UID, 'lsid.uid (sha256 of the empty user name)');
      same(e.clusterTime, txn[0].clusterTime, 'all events of a transaction share the commit clusterTime');
    }
    assertIncreasingTokens(events, 'transaction');
    assert(!('lsid' in events[3]) && !('txnNumber' in events[3]), `a non-transaction event carries lsid/txnNumber: ${show(events[3])}`);
    // an aborted transaction leaves no events
    session.startTransaction();
    await db.collection('t1').insertOne({ _id: 'aborted' }, { session });
    await session.abortTransaction();
    await db.collection('t1').insertOne({ _id: 'after-abort' });
    same((await nextEvent(cs))?.documentKey, { _id: 'after-abort' }, 'first event after an aborted transaction');
  } finally {
    await session.endSession();
    await cs.close();
  }
};

checks.pre_and_post_images = async ({ db }) => {
  await db.createCollection('img');
  await db.command({ collMod: 'img', changeStreamPreAndPostImages: { enabled: true } });
  const opts = (await db.listCollections({ name: 'img' }).toArray())[0].options;
  same(opts.changeStreamPreAndPostImages, { enabled: true }, 'collection options after collMod');
  const coll = db.collection('img');
  await coll.insertOne({ _id: 1, v: 1 });
  await db.collection('plain').insertOne({ _id: 1, v: 1 });
  const cs = await open(coll.watch([], { fullDocumentBeforeChange: 'whenAvailable', fullDocument: 'whenAvailable', maxAwaitTimeMS: AWAIT_MS }));
  try {
    await coll.updateOne({ _id: 1 }, { $set: { v: 2 } });
    await coll.replaceOne({ _id: 1 }, { v: 3 });
    await coll.deleteOne({ _id: 1 });
    const [upd, rep, del] = await collect(cs, 3);
    keysOf(upd, 'update with images', ['_id', 'operationType', 'clusterTime', 'wallTime', 'fullDocument', 'ns', 'documentKey', 'updateDescription', 'fullDocumentBeforeChange']);
    same([upd.fullDocumentBeforeChange, upd.fullDocument], [{ _id: 1, v: 1 }, { _id: 1, v: 2 }], 'update pre/post images');
    keysOf(rep, 'replace with images', ['_id', 'operationType', 'clusterTime', 'wallTime', 'fullDocument', 'ns', 'documentKey', 'fullDocumentBeforeChange']);
    same([rep.fullDocumentBeforeChange, rep.fullDocument], [{ _id: 1, v: 2 }, { _id: 1, v: 3 }], 'replace pre/post images');
    keysOf(del, 'delete with images', ['_id', 'operationType', 'clusterTime', 'wallTime', 'ns', 'documentKey', 'fullDocumentBeforeChange']);
    same(del.fullDocumentBeforeChange, { _id: 1, v: 3 }, 'delete pre-image');
  } finally {
    await cs.close();
  }
  // a collection without changeStreamPreAndPostImages: whenAvailable -> null, required -> error 47
  const plain = db.collection('plain');
  const cs2 = await open(plain.watch([], { fullDocumentBeforeChange: 'whenAvailable', maxAwaitTimeMS: AWAIT_MS }));
  try {
    await plain.updateOne({ _id: 1 }, { $set: { v: 2 } });
    const ev = await nextEvent(cs2);
    assert(ev && 'fullDocumentBeforeChange' in ev, `update without pre-images lacks fullDocumentBeforeChange: ${show(ev)}`);
    same(ev.fullDocumentBeforeChange, null, 'whenAvailable pre-image on a collection without images');
  } finally {
    await cs2.close();
  }
  const cs3 = await open(plain.watch([], { fullDocumentBeforeChange: 'required', maxAwaitTimeMS: AWAIT_MS }));
  try {
    await plain.updateOne({ _id: 1 }, { $set: { v: 3 } });
    await expectServerError(nextEvent(cs3), 47, "fullDocumentBeforeChange 'required' without pre-images");
  } finally {
    await cs3.close();
  }
};

checks.await_data_wakeup = async ({ db }) => {
  const coll = db.collection('wake');
  await db.createCollection('wake');
  const cs = await open(coll.watch([], { maxAwaitTimeMS: 1500 }));
  try {
    // an unrelated write does not end the awaitData wait early
    let started = Date.now();
    setTimeout(() => db.collection('unrelated').insertOne({ _id: 1 }).catch(() => {}), 200);
    assert((await cs.tryNext()) === null, 'tryNext returned an event for another collection');
    let waited = Date.now() - started;
    assert(waited >= 1300, `an unrelated write woke the getMore after ${waited} ms (maxAwaitTimeMS 1500)`);
    // a relevant write does
    started = Date.now();
    setTimeout(() => coll.insertOne({ _id: 1 }).catch(() => {}), 200);
    const ev = await cs.tryNext();
    waited = Date.now() - started;
    same(ev?.documentKey, { _id: 1 }, 'event delivered by the waiting getMore');
    assert(waited < 1200, `the getMore waited ${waited} ms although a matching event arrived after 200 ms`);
  } finally {
    await cs.close();
  }
  // without maxAwaitTimeMS the getMore carries no maxTimeMS and the server waits its default 1 s
  const plain = await open(coll.watch());
  try {
    const started = Date.now();
    assert((await plain.tryNext()) === null, 'idle stream returned an event');
    const waited = Date.now() - started;
    assert(waited >= 900 && waited < 2500, `an idle getMore without maxTimeMS returned after ${waited} ms (mongod waits 1000 ms)`);
  } finally {
    await plain.close();
  }
};

checks.batch_size_and_comment = async ({ log, db }) => {
  const coll = db.collection('batch');
  await db.createCollection('batch');
  const mark = log.mark();
  const cs = await open(coll.watch([], { batchSize: 2, comment: 'fidelity', maxAwaitTimeMS: AWAIT_MS }));
  try {
    await coll.insertMany([1, 2, 3, 4, 5].map(i => ({ _id: i })));
    same((await collect(cs, 5)).map(e => e.documentKey._id), [1, 2, 3, 4, 5], 'events read in batches of 2');
    const agg = log.since(mark, 'commandStarted', 'aggregate')[0].command;
    same([agg.cursor, agg.comment], [{ batchSize: 2 }, 'fidelity'], 'aggregate cursor/comment');
    const gms = log.since(mark, 'commandStarted', 'getMore').map(e => e.command);
    assert(gms.every(g => Number(g.batchSize) === 2 && g.comment === 'fidelity'), `getMore batchSize/comment: ${show(gms)}`);
    const batches = log.since(mark, 'commandSucceeded', 'getMore').map(e => e.reply.cursor.nextBatch.length);
    assert(batches.every(n => n <= 2), `a getMore returned more than batchSize 2: ${show(batches)}`);
    same(batches.filter(n => n > 0), [2, 2, 1], 'non-empty getMore batch sizes');
  } finally {
    await cs.close();
  }
};

checks.start_after_resume = async ({ client, log, db, info }) => {
  // a stream started with startAfter that has returned nothing resumes with startAfter
  const coll = db.collection('sa');
  await coll.insertOne({ _id: 0 });
  const cs0 = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  let token;
  try {
    await coll.insertOne({ _id: 1 });
    token = (await nextEvent(cs0))._id;
  } finally {
    await cs0.close();
  }
  const cs = coll.watch([], { startAfter: token, maxAwaitTimeMS: AWAIT_MS });
  try {
    const opened = log.mark();
    assert((await cs.tryNext()) === null, 'startAfter the newest event replayed something');
    const mark = log.mark();
    // the driver resumes from the last postBatchResumeToken it got: on a quiet replica set that
    // is the startAfter token; mongos's idle getMores advance it (shards' periodic no-ops)
    const lastPbrt = log.events.slice(0, mark).filter(e => e.kind === 'commandSucceeded' && e.event.reply?.cursor?.postBatchResumeToken)
      .map(e => e.event.reply.cursor.postBatchResumeToken).at(-1);
    const firstPbrt = log.since(opened, 'commandSucceeded', 'aggregate')[0]?.reply.cursor.postBatchResumeToken;
    same(firstPbrt, token, 'postBatchResumeToken of the startAfter aggregate');
    if (info.topology === 'replicaset') same(lastPbrt, token, 'postBatchResumeToken before any event');
    await withFailPoint(client, 'failCommand', { times: 1 }, { failCommands: ['getMore'], closeConnection: true }, async () => {
      assert((await cs.tryNext()) === null, 'tryNext after the network error returned an event');
    });
    const resumed = log.since(mark, 'commandStarted', 'aggregate')[0]?.command.pipeline[0].$changeStream;
    assert(resumed, 'no resume aggregate after the network error');
    same([resumed.startAfter, resumed.resumeAfter], [lastPbrt, undefined], 'resume options before any event (startAfter the cached token)');
    assert(lastPbrt._data >= token._data, `cached token ${lastPbrt._data} sorts before the startAfter token ${token._data}`);
    await coll.insertOne({ _id: 2 });
    same((await nextEvent(cs))?.documentKey, { _id: 2 }, 'event after the resume');
    await expectQuiet(cs, 'startAfter resume');
  } finally {
    await cs.close();
  }
};

checks.socket_timeout_then_resume = async ({ client, uri, db }) => {
  // a getMore blocked (failCommand blockConnection, filtered by appName) past the client's
  // socketTimeoutMS is a network timeout: the driver abandons the connection and resumes
  // (the Node driver 7.x ignores CSOT timeoutMS, so socketTimeoutMS plays its role here)
  const appName = 'node-fidelity-socket';
  const slow = new MongoClient(uri, { appName, socketTimeoutMS: 500, monitorCommands: true, serverSelectionTimeoutMS: 10_000 });
  const slowLog = new CommandLog(slow);
  const coll = slow.db(db.databaseName).collection('sto');
  await db.createCollection('sto');
  const cs = await open(coll.watch([], { maxAwaitTimeMS: 50 }));
  try {
    const mark = slowLog.mark();
    await withFailPoint(client, 'failCommand', { times: 1 }, { failCommands: ['getMore'], blockConnection: true, blockTimeMS: 900, appName }, async () => {
      await db.collection('sto').insertOne({ _id: 1 });
      const ev = await nextEvent(cs);
      same(ev?.documentKey, { _id: 1 }, 'event across the socket timeout');
    });
    await expectQuiet(cs, 'after the socket-timeout resume');
    const failed = slowLog.since(mark, 'commandFailed', 'getMore').map(e => e.failure);
    assert(failed.length === 1 && failed[0].name === 'MongoNetworkTimeoutError', `getMore failures: ${show(failed.map(f => [f.name, f.message]))}`);
    same(slowLog.since(mark, 'commandStarted', 'aggregate').length, 1, 'resume aggregates');
    // the failpoint only matched the slow client: the main client's getMores kept working
  } finally {
    await cs.close();
    await slow.close();
  }
};

checks.emitter_and_async_iterator = async ({ log, db }) => {
  const coll = db.collection('emit');
  await db.createCollection('emit');
  // emitter mode: the driver iterates in the background
  const mark = log.mark();
  const cs = coll.watch([], { maxAwaitTimeMS: AWAIT_MS });
  const seen = [];
  const errors = [];
  cs.on('change', change => seen.push(change));
  cs.on('error', err => errors.push(err));
  let token;
  try {
    const opened = Date.now() + 5000;
    while (log.since(mark, 'commandSucceeded', 'aggregate').length === 0 && Date.now() < opened) await sleep(20);
    assert(log.since(mark, 'commandSucceeded', 'aggregate').length === 1, 'the emitter-mode stream never opened');
    await coll.insertMany([{ _id: 1 }, { _id: 2 }, { _id: 3 }]);
    const deadline = Date.now() + 5000;
    while (seen.length < 3 && Date.now() < deadline) await sleep(50);
    same(seen.map(c => c.documentKey._id), [1, 2, 3], 'events in emitter mode');
    same(errors.map(e => e.message), [], 'emitter-mode errors');
    token = seen[0]._id;
  } finally {
    await cs.close();
  }
  // for await, resuming after the first emitted event
  const it = coll.watch([], { maxAwaitTimeMS: AWAIT_MS, resumeAfter: token });
  const got = [];
  for await (const change of it) { // the iterator closes the stream on break
    got.push(change.documentKey._id);
    if (got.length === 2) break;
  }
  same(got, [2, 3], 'for await after resumeAfter');
  assert(it.closed, 'for await did not close the stream on break');
};

function tokenTime(token) {
  const data = token._data;
  return [parseInt(data.slice(2, 10), 16), parseInt(data.slice(10, 18), 16)];
}

checks.future_start_at_operation_time = async ({ db }) => {
  const coll = db.collection('future');
  await db.createCollection('future');
  const hello = await db.admin().command({ hello: 1 });
  const now = hello.operationTime;
  const future = new Timestamp({ t: now.high + 3600, i: 1 });
  const cs = await open(coll.watch([], { startAtOperationTime: future, maxAwaitTimeMS: AWAIT_MS }));
  try {
    const t0 = cs.resumeToken;
    assert(t0 && isHighWaterMark(t0), `initial resumeToken with a future startAtOperationTime: ${show(t0)}`);
    same(tokenTime(t0), [future.high, future.low], 'initial postBatchResumeToken clusterTime = startAtOperationTime');
    await coll.insertOne({ _id: 1 });
    assert((await cs.tryNext()) === null, 'an event before startAtOperationTime was delivered');
    same(cs.resumeToken, t0, 'resumeToken with a future startAtOperationTime after a write (must stay put)');
  } finally {
    await cs.close();
  }
};

checks.pipeline_errors = async ({ client, db }) => {
  const coll = db.collection('errs');
  await db.createCollection('errs');
  const firstError = async (cs, code, what) => {
    try {
      return await expectServerError(cs.tryNext(), code, what);
    } finally {
      await cs.close();
    }
  };
  await firstError(coll.watch([{ $foo: {} }]), 40324, 'unknown stage');
  await firstError(coll.watch([{ $changeStream: {} }]), 40602, '$changeStream not first');
  await firstError(coll.watch([], { fullDocument: 'bogus' }), 2, "fullDocument 'bogus'");
  await firstError(client.db('local').watch(), 73, 'stream on the local database');
  await firstError(client.db('admin').watch(), 73, 'stream on admin without allChangesForCluster');
  await firstError(db.collection('system.foo').watch(), 73, 'stream on a system collection');
  const probe = await open(coll.watch());
  const token = probe.resumeToken;
  await probe.close();
  await firstError(coll.watch([], { resumeAfter: token, startAfter: token }), 50865, 'resumeAfter + startAfter');
  // a pipeline that removes _id fails on the first event, non-resumably
  const cs = await open(coll.watch([{ $project: { _id: 0 } }], { maxAwaitTimeMS: AWAIT_MS }));
  try {
    await coll.insertOne({ _id: 1 });
    const err = await expectServerError(nextEvent(cs), 280, 'event whose _id was projected out');
    assert(err.errorLabels?.includes('NonResumableChangeStreamError'), `280 lacks NonResumableChangeStreamError: ${show(err.errorLabels)}`);
    assert(cs.closed, 'the stream is open after a ChangeStreamFatalError');
  } finally {
    await cs.close();
  }
};

checks.retryable_reads_and_writes = async ({ client, log, db }) => {
  const coll = db.collection('retry');
  await db.createCollection('retry');
  // the initial aggregate of a change stream is a retryable read
  let mark = log.mark();
  await withFailPoint(client, 'failCommand', { times: 1 }, { failCommands: ['aggregate'], errorCode: 6 }, async () => {
    const cs = coll.watch([], { maxAwaitTimeMS: AWAIT_MS });
    try {
      await open(cs);
      await coll.insertOne({ _id: 1 });
      same((await nextEvent(cs))?.documentKey, { _id: 1 }, 'event after a retried aggregate');
    } finally {
      await cs.close();
    }
  });
  same(log.since(mark, 'commandStarted', 'aggregate').length, 2, 'aggregates (first failed with 6, retried once)');
  // a write whose connection closes is retried once with the same txnNumber and applied once
  mark = log.mark();
  await withFailPoint(client, 'failCommand', { times: 1 }, { failCommands: ['insert'], closeConnection: true }, async () => {
    await coll.insertOne({ _id: 2 });
  });
  const inserts = log.since(mark, 'commandStarted', 'insert').map(e => e.command);
  same(inserts.length, 2, 'insert attempts');
  same(Number(inserts[0].txnNumber), Number(inserts[1].txnNumber), 'the retry reuses txnNumber');
  same(await coll.countDocuments({ _id: 2 }), 1, 'documents after a retried insert');
};

checks.compression_zlib = async ({ uri, db }) => {
  const zipped = new MongoClient(uri, { compressors: ['zlib'], serverSelectionTimeoutMS: 10_000 });
  try {
    const coll = zipped.db(db.databaseName).collection('zlib');
    await zipped.db(db.databaseName).createCollection('zlib');
    const cs = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
    try {
      const big = 'x'.repeat(100_000);
      await coll.insertOne({ _id: 1, big });
      same((await coll.findOne({ _id: 1 }))?.big?.length, big.length, 'document read back through a zlib client');
      same((await nextEvent(cs))?.fullDocument?.big?.length, big.length, 'event through a zlib client');
    } finally {
      await cs.close();
    }
  } finally {
    await zipped.close();
  }
};

checks.compression_negotiation = async ({ uri }) => {
  // mongod (net.compression.compressors defaults to snappy,zstd,zlib) accepts the zlib the
  // driver offers in its handshake, and every later hello on that connection lists it
  const zipped = new MongoClient(uri, { compressors: ['zlib'], serverSelectionTimeoutMS: 10_000 });
  try {
    const hello = await zipped.db('admin').command({ hello: 1 });
    same(hello.compression, ['zlib'], "hello.compression on a connection whose handshake offered ['zlib']");
  } finally {
    await zipped.close();
  }
};

checks.split_large_event = async ({ db, info }) => {
  // spec prose test 19 (servers >= 6.0.9 <6.1, or >= 7.0)
  const [major, minor, patch] = info.versionArray;
  if (!(major >= 7 || (major === 6 && minor === 0 && patch >= 9))) throw new CheckSkipped(`$changeStreamSplitLargeEvent needs 6.0.9+ or 7.0+, server is ${info.version}`);
  await db.createCollection('split', { changeStreamPreAndPostImages: { enabled: true } });
  const coll = db.collection('split');
  const mb10 = 10 * 1024 * 1024;
  await coll.insertOne({ _id: 1, value: 'q'.repeat(mb10) });
  const pipeline = [{ $changeStreamSplitLargeEvent: {} }];
  const cs = await open(coll.watch(pipeline, { fullDocumentBeforeChange: 'required', maxAwaitTimeMS: AWAIT_MS }));
  let fragments;
  try {
    await coll.updateOne({}, { $set: { value: 'z'.repeat(mb10) } });
    fragments = await collect(cs, 2, 20_000);
  } finally {
    await cs.close();
  }
  same(fragments.map(f => f.splitEvent), [{ fragment: 1, of: 2 }, { fragment: 2, of: 2 }], 'splitEvent of the fragments');
  // fields sorted by BSON size, greedily packed (change_stream_split_event_helpers.cpp)
  keysOf(fragments[0], 'fragment 1', ['_id', 'splitEvent', 'wallTime', 'clusterTime', 'operationType', 'documentKey', 'ns', 'fullDocumentBeforeChange']);
  keysOf(fragments[1], 'fragment 2', ['_id', 'splitEvent', 'updateDescription']);
  same(fragments[0].fullDocumentBeforeChange.value.length, mb10, 'pre-image in fragment 1');
  same(fragments[1].updateDescription.updatedFields.value.length, mb10, 'updated value in fragment 2');
  assertIncreasingTokens(fragments, 'fragments');
  // resuming after fragment 1 delivers fragment 2 only
  const cs2 = coll.watch(pipeline, { fullDocumentBeforeChange: 'required', resumeAfter: fragments[0]._id, maxAwaitTimeMS: AWAIT_MS });
  try {
    const next = await nextEvent(cs2, 10_000);
    same([next?._id, next?.splitEvent], [fragments[1]._id, { fragment: 2, of: 2 }], 'resume after fragment 1');
  } finally {
    await cs2.close();
  }
  // without the split stage the oversized event fails (BSONObjectTooLarge)
  const cs3 = coll.watch([], { fullDocumentBeforeChange: 'required', startAtOperationTime: fragments[0].clusterTime });
  try {
    await expectServerError(cs3.tryNext(), 10334, 'oversized event without $changeStreamSplitLargeEvent');
  } finally {
    await cs3.close();
  }
};

checks.secondary_read = async ({ client, log, db }) => {
  // change streams may read from secondaries; they see the same events with the same tokens
  const coll = db.collection('sec');
  await db.createCollection('sec');
  const hello = await db.admin().command({ hello: 1 });
  const mark = log.mark();
  const onPrimary = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  const onSecondary = await open(coll.watch([], { readPreference: 'secondary', fullDocument: 'updateLookup', maxAwaitTimeMS: AWAIT_MS }));
  try {
    const addresses = log.since(mark, 'commandStarted', 'aggregate').map(e => e.address);
    same(addresses[0], hello.primary, 'primary stream address');
    assert(addresses[1] !== hello.primary && hello.hosts.includes(addresses[1]), `secondary stream ran on ${addresses[1]}`);
    await coll.insertOne({ _id: 1, v: 1 });
    await coll.updateOne({ _id: 1 }, { $set: { v: 2 } });
    const p = await collect(onPrimary, 2);
    const s = await collect(onSecondary, 2);
    same(s.map(e => e._id), p.map(e => e._id), 'resume tokens on the secondary = on the primary');
    same(s[1].fullDocument, { _id: 1, v: 2 }, 'updateLookup on a secondary');
  } finally {
    await onPrimary.close();
    await onSecondary.close();
  }
};

checks.client_bulk_write = async ({ client, log, db }) => {
  // MongoClient.bulkWrite sends the 8.0 "bulkWrite" admin command (OP_MSG document sequences
  // "ops" and "nsInfo"); older servers make the driver refuse it client-side
  const hello = await db.admin().command({ hello: 1 });
  if (hello.maxWireVersion < 25) throw new CheckSkipped(`the bulkWrite command needs 8.0+ (wire 25), server has wire ${hello.maxWireVersion}`);
  const a = `${db.databaseName}.a`;
  const b = `${db.databaseName}.b`;
  const cs = await open(db.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  try {
    const mark = log.mark();
    const result = await client.bulkWrite([
      { name: 'insertOne', namespace: a, document: { _id: 1, v: 1 } },
      { name: 'insertOne', namespace: b, document: { _id: 2, v: 1 } },
      { name: 'updateOne', namespace: a, filter: { _id: 1 }, update: { $set: { v: 2 } } },
      { name: 'deleteOne', namespace: b, filter: { _id: 2 } },
    ]);
    same([result.insertedCount, result.matchedCount, result.modifiedCount, result.deletedCount], [2, 1, 1, 1], 'bulkWrite counts');
    same(log.since(mark, 'commandStarted', 'bulkWrite')[0]?.databaseName, 'admin', 'bulkWrite runs on admin');
    const events = await collect(cs, 4);
    same(events.map(e => [e.operationType, e.ns.coll]), [['insert', 'a'], ['insert', 'b'], ['update', 'a'], ['delete', 'b']], 'events of a client bulkWrite');
    same(await db.collection('a').findOne({ _id: 1 }), { _id: 1, v: 2 }, 'document after bulkWrite');
  } finally {
    await cs.close();
  }
};

// ------------------------------------------------------------------------------------------------
// sharded clusters (mongos)

checks.sharded_topology = async ({ client, info, hosts }) => {
  const hello = await client.db('admin').command({ hello: 1 });
  same(hello.msg, 'isdbgrid', 'hello.msg of a mongos');
  assert(hello.isWritablePrimary === true, `hello.isWritablePrimary: ${hello.isWritablePrimary}`);
  for (const field of ['setName', 'hosts', 'primary', 'secondary', 'electionId', 'lastWrite']) {
    same(hello[field], undefined, `hello.${field} of a mongos`);
  }
  assert(hello.topologyVersion?.processId instanceof ObjectId, `hello.topologyVersion: ${show(hello.topologyVersion)}`);
  same([hello.maxBsonObjectSize, hello.maxMessageSizeBytes, hello.maxWriteBatchSize],
    [16777216, 48000000, 100000], 'hello size limits');
  same(hello.logicalSessionTimeoutMinutes, 30, 'hello.logicalSessionTimeoutMinutes');
  const expectedWire = WIRE_VERSIONS[info.majorMinor];
  if (expectedWire !== undefined) same(hello.maxWireVersion, expectedWire, `hello.maxWireVersion for ${info.version}`);
  assert(hello.$clusterTime?.clusterTime instanceof Timestamp, 'hello reply lacks $clusterTime');
  // the driver's own view of the URI with every mongos: a Sharded topology of Mongos servers
  const all = new MongoClient(`mongodb://${hosts.join(',')}/`, { serverSelectionTimeoutMS: 10_000, heartbeatFrequencyMS: 500 });
  try {
    await all.db('admin').command({ ping: 1 });
    const deadline = Date.now() + 10_000;
    let description;
    let types;
    for (;;) {
      description = all.topology?.description;
      types = [...(description?.servers?.values() ?? [])].map(s => s.type);
      if (description?.type === 'Sharded' && types.length === hosts.length && types.every(t => t === 'Mongos')) break;
      if (Date.now() > deadline) throw new CheckFailure(`driver topology after 10 s: ${description?.type} ${show(types)}`);
      await sleep(100);
    }
  } finally {
    await all.close();
  }
};

/** `db.spread` sharded on {x: 1}: x < 0 on the first shard, x >= 0 on the second. */
async function rangeSharded(client, db) {
  const admin = client.db('admin');
  const shards = (await admin.command({ listShards: 1 })).shards;
  assert(shards.length >= 2, `listShards: expected 2 shards or more, got ${show(shards)}`);
  const ns = `${db.databaseName}.spread`;
  await admin.command({ enableSharding: db.databaseName });
  await admin.command({ shardCollection: ns, key: { x: 1 } });
  await admin.command({ split: ns, middle: { x: 0 } });
  await admin.command({ moveChunk: ns, find: { x: -1 }, to: shards[0]._id });
  await admin.command({ moveChunk: ns, find: { x: 1 }, to: shards[1]._id });
  return { coll: db.collection('spread'), shards };
}

/** How many documents of `coll` the shard `host` ("set/host:port,...") holds, asked directly. */
async function countOnShard(shardHost, dbName, collName) {
  const seed = shardHost.split('/').pop();
  const direct = new MongoClient(`mongodb://${seed}/?directConnection=true`, { serverSelectionTimeoutMS: 5000 });
  try {
    return await direct.db(dbName).collection(collName).countDocuments({});
  } finally {
    await direct.close();
  }
}

checks.sharded_merge_order = async ({ client, log, db }) => {
  // events from both shards come out of mongos merged in resume-token order; the initial
  // aggregate's first batch is empty and carries a postBatchResumeToken
  const { coll, shards } = await rangeSharded(client, db);
  const mark = log.mark();
  const cs = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  try {
    const opened = log.since(mark, 'commandSucceeded', 'aggregate').map(e => e.reply.cursor);
    same(opened.length, 1, 'aggregates sent to open the stream');
    same(opened[0].firstBatch.length, 0, 'size of the first batch through mongos');
    assert(opened[0].postBatchResumeToken?._data, `first batch lacks a postBatchResumeToken: ${show(opened[0])}`);
    const xs = [];
    for (let i = 1; i <= 4; i++) {
      await coll.insertOne({ _id: `n${i}`, x: -i });
      await coll.insertOne({ _id: `p${i}`, x: i });
      xs.push(-i, i);
    }
    await coll.insertMany([{ _id: 'm-5', x: -5 }, { _id: 'm5', x: 5 }]);
    xs.push(-5, 5);
    await coll.updateOne({ x: -2 }, { $set: { y: 1 } });
    await coll.deleteOne({ x: 3 });
    same([await countOnShard(shards[0].host, db.databaseName, 'spread'), await countOnShard(shards[1].host, db.databaseName, 'spread')],
      [5, 4], 'documents on each shard (x < 0, x >= 0)');
    const events = await collect(cs, xs.length + 2, 15_000);
    same(events.map(e => e.operationType), [...xs.map(() => 'insert'), 'update', 'delete'], 'operation types');
    same(events.slice(0, xs.length).map(e => e.fullDocument.x), xs, 'events in write order across both shards');
    assertIncreasingTokens(events, 'events from both shards');
    for (const e of events) keysOf(e.documentKey, `${e.operationType} documentKey`, ['x', '_id']);
    same(events.at(-2).documentKey, { x: -2, _id: 'n2' }, 'update documentKey carries the shard key');
    same(events.at(-1).documentKey, { x: 3, _id: 'p3' }, 'delete documentKey carries the shard key');
    await expectQuiet(cs, 'after the merged events');
  } finally {
    await cs.close();
  }
};

checks.sharded_resume_other_mongos = async ({ client, db, hosts }) => {
  // a token from one mongos resumes the stream through another
  assert(hosts.length >= 2, `this check needs a URI with two mongoses, got ${show(hosts)}`);
  const { coll } = await rangeSharded(client, db);
  const cs = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  let token;
  try {
    await coll.insertOne({ _id: 'a', x: -1 });
    await coll.insertOne({ _id: 'b', x: 1 });
    await coll.insertOne({ _id: 'c', x: -2 });
    const events = await collect(cs, 3);
    token = events[0]._id;
  } finally {
    await cs.close();
  }
  const other = new MongoClient(`mongodb://${hosts[1]}/`, { monitorCommands: true, serverSelectionTimeoutMS: 10_000 });
  const otherLog = new CommandLog(other);
  try {
    const cs2 = other.db(db.databaseName).collection('spread').watch([], { resumeAfter: token, maxAwaitTimeMS: AWAIT_MS });
    try {
      const replayed = await collect(cs2, 2);
      same(replayed.map(e => e.documentKey._id), ['b', 'c'], 'events after the token, through the other mongos');
      await coll.insertOne({ _id: 'd', x: 2 });
      same((await nextEvent(cs2))?.documentKey, { x: 2, _id: 'd' }, 'new event through the other mongos');
      await expectQuiet(cs2, 'resumed through the other mongos');
      const aggs = otherLog.since(0, 'commandStarted', 'aggregate');
      same(aggs.map(a => a.address), [hosts[1]], 'the resumed stream runs on the other mongos');
    } finally {
      await cs2.close();
    }
  } finally {
    await other.close();
  }
};

// checks that need one topology; `skip <name>: <why>` on the other
const ONLY_ON = {
  topology: ['replicaset', 'checks a replica set hello and SDAM view; sharded_topology is the mongos equivalent'],
  secondary_read: ['replicaset', 'reads from a secondary named in hello.hosts; a mongos lists no members'],
  sharded_topology: ['sharded', 'needs mongos'],
  sharded_merge_order: ['sharded', 'needs mongos and two shards'],
  sharded_resume_other_mongos: ['sharded', 'needs two mongoses'],
};

// where the simulated mongos is known to differ from a real one or lacks a feature (reported in
// the slow suite's output, tracked on the sharding issue): skipped on a sharded cluster
const SHARDED_SIMULATOR_GAPS = {
  transaction_events: "the simulator's mongos does not run transactions (code 263)",
  client_bulk_write: "the simulator's mongos has no bulkWrite command (8.0 mongos has it)",
};

// ------------------------------------------------------------------------------------------------
// the failover check, driven from outside through stdin/stdout

async function readLine() {
  const rl = createInterface({ input: process.stdin });
  try {
    for await (const line of rl) return line;
    return null;
  } finally {
    rl.close();
  }
}

async function failover({ client, log, db }) {
  const coll = db.collection('events');
  await db.createCollection('events');
  const cs = await open(coll.watch([], { maxAwaitTimeMS: AWAIT_MS }));
  try {
    await coll.insertOne({ _id: 'before' });
    const first = await nextEvent(cs);
    same(first?.documentKey, { _id: 'before' }, 'event before the step-down');
    const mark = log.mark();
    // keep a getMore in flight while the primary goes away
    const received = [];
    let stop = false;
    const poller = (async () => {
      while (!stop) {
        const change = await cs.tryNext();
        if (change !== null) received.push(change);
      }
    })();
    process.stdout.write(`READY ${db.databaseName}.events ${first._id._data}\n`);
    const line = await readLine();
    assert(line !== null && line.startsWith('go '), `expected "go <crash|stepdown> <new primary> [ids]" on stdin, got ${show(line)}`);
    const [, how, newPrimary, ...externalIds] = line.trim().split(/\s+/);
    assert(how === 'crash' || how === 'stepdown', `unknown failover kind ${how}`);
    await coll.insertOne({ _id: 'after-1' });
    await coll.insertOne({ _id: 'after-2' });
    const expected = [...externalIds, 'after-1', 'after-2'];
    const deadline = Date.now() + 20_000;
    while (received.length < expected.length && Date.now() < deadline) await sleep(50);
    await sleep(3 * AWAIT_MS); // would a duplicate show up?
    stop = true;
    await poller;
    same(received.map(e => e.documentKey._id), expected, 'events after the step-down (nothing lost, nothing twice)');
    const aggs = log.since(mark, 'commandStarted', 'aggregate');
    if (how === 'crash') {
      // the old primary's connections and cursors are gone: the driver must resume there
      assert(aggs.length >= 1, 'the driver never resumed (no aggregate after the crash)');
      same(aggs[0].command.pipeline[0].$changeStream.resumeAfter, first._id, 'resume token used after the crash');
      same(aggs.at(-1).address, newPrimary, 'the resumed stream runs on the new primary');
    } else {
      // replSetStepDown (4.2+) keeps connections and cursors: the stream goes on, now reading
      // from a secondary, without resuming
      same(aggs.length, 0, 'resume aggregates after a stepdown that keeps connections');
      same(log.since(mark, 'commandFailed', 'getMore').length, 0, 'failed getMores after a stepdown that keeps connections');
    }
    const failures = log.since(mark, 'commandFailed', 'getMore').map(e => `${e.address} ${e.failure?.name}: ${e.failure?.message}`);
    console.log(`# failover: getMore failures [${failures.join('; ')}], resume aggregates on [${aggs.map(a => a.address).join(', ')}]`);
  } finally {
    await cs.close();
  }
}

// ------------------------------------------------------------------------------------------------
// runner

function describeError(err) {
  let text = `${err?.name ?? 'Error'}: ${err?.message ?? err}${err?.code !== undefined ? ` (code ${err.code})` : ''}`;
  if (err?.cause) text += `; caused by ${describeError(err.cause)}`;
  return text;
}

function withTimeout(promise, ms) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new CheckFailure(`timed out after ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** The host:port list of a mongodb:// URI, in order. */
function uriHosts(uri) {
  return uri.replace(/^mongodb(\+srv)?:\/\//, '').replace(/^[^@/]*@/, '').split(/[/?]/)[0].split(',');
}

async function main() {
  const argv = process.argv.slice(2);
  let uri = process.env.MONGODB_URI;
  let only = null;
  let failoverMode = false;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '--failover') failoverMode = true;
    else if (arg === '--only') only = argv[++i].split(',');
    else if (arg.startsWith('--only=')) only = arg.slice(7).split(',');
    else if (arg.startsWith('mongodb://') || arg.startsWith('mongodb+srv://')) uri = arg;
    else {
      console.error(`unknown argument: ${arg}`);
      return 2;
    }
  }
  if (!uri) {
    console.error('usage: node fidelity.mjs <mongodb URI> [--only a,b] [--failover]  (or set MONGODB_URI)');
    return 2;
  }
  const selected = failoverMode ? { failover } : Object.fromEntries(
    Object.entries(checks).filter(([name]) => only === null || only.includes(name)));
  if (only !== null && !failoverMode) {
    const unknown = only.filter(n => !(n in checks));
    if (unknown.length > 0) {
      console.error(`unknown checks: ${unknown.join(', ')}; known: ${Object.keys(checks).join(', ')}`);
      return 2;
    }
  }

  const hosts = uriHosts(uri);
  let passed = 0;
  let failed = 0;
  let client;
  try {
    const probe = new MongoClient(uri, { serverSelectionTimeoutMS: 10_000 });
    let hello;
    try {
      hello = await probe.db('admin').command({ hello: 1 });
    } finally {
      await probe.close();
    }
    const topology = hello.msg === 'isdbgrid' ? 'sharded' : 'replicaset';
    if (topology === 'sharded') uri = uri.replace(hosts.join(','), hosts[0]);
    client = new MongoClient(uri, { monitorCommands: true, serverSelectionTimeoutMS: 10_000, heartbeatFrequencyMS: 500, appName: 'node-fidelity' });
    const log = new CommandLog(client);
    await client.connect();
    const build = await client.db('admin').command({ buildInfo: 1 });
    const info = { version: build.version, versionArray: build.versionArray, majorMinor: build.version.split('.').slice(0, 2).join('.'), topology };
    console.log(`# node ${process.version}, mongodb driver, server ${info.version}, topology ${topology}${topology === 'sharded' ? ` (checks through mongos ${hosts[0]}; mongoses ${hosts.join(' ')})` : ''}, checks: ${Object.keys(selected).join(' ')}`);
    for (const [name, fn] of Object.entries(selected)) {
      const [needs, why] = ONLY_ON[name] ?? [topology, ''];
      if (!failoverMode && needs !== topology) {
        console.log(`skip ${name}: ${needs} only: ${why}`);
        continue;
      }
      if (!failoverMode && topology === 'sharded' && name in SHARDED_SIMULATOR_GAPS) {
        console.log(`skip ${name}: simulator gap on mongos: ${SHARDED_SIMULATOR_GAPS[name]}`);
        continue;
      }
      const db = client.db(failoverMode ? uniqueName('nodefid_failover') : uniqueName(`nodefid_${name}`.slice(0, 40)));
      try {
        await withTimeout(fn({ client, log, db, info, uri, hosts }), failoverMode ? 60_000 : CHECK_TIMEOUT_MS);
        console.log(`ok ${name}`);
        passed++;
      } catch (err) {
        if (err instanceof CheckSkipped) {
          console.log(`skip ${name}: ${err.message}`);
          continue;
        }
        const why = err instanceof CheckFailure ? err.message : describeError(err);
        console.log(`FAIL ${name}: ${why.replace(/\n/g, ' ')}`);
        failed++;
      } finally {
        await db.dropDatabase().catch(() => {});
      }
    }
  } catch (err) {
    console.log(`FAIL connect: ${err?.name}: ${err?.message}`);
    failed++;
  } finally {
    await client?.close().catch(() => {});
  }
  console.log(`${passed} passed, ${failed} failed`);
  return failed === 0 ? 0 : 1;
}

process.exitCode = await main();
