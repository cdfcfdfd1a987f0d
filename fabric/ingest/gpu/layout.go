package gpu

// The Go side of fb_trigger.h, and the offsets of fb_ingest.h this package
// reads itself. TestLayout compiles both headers and compares every one.

const (
	threads      = 256   // FB_TRIGGER_THREADS
	chunk        = 1024  // FB_TRIGGER_CHUNK
	staticShared = 62232 // the kernels' block_shared, as the PTX declares it
	maxGaps      = 64    // FB_TRIGGER_MAX_GAPS, ingest.MaxGaps

	argsSize   = 128
	ctrlSize   = 64
	jobSize    = 64
	resultSize = 64
	stateSize  = 384
	sourceSize = 104
	gapSize    = 24
)

// struct fb_trigger_args
const (
	aRegion      = 0
	aCtrl        = 8
	aResults     = 16
	aJobs        = 24
	aState       = 32
	aSources     = 40
	aGaps        = 48
	aFirstSeq    = 56
	aThreshold   = 64
	aDescOff     = 72
	aBuffersOff  = 80
	aBufferCount = 88
	aBufferSize  = 92
	aMaxSources  = 96
	aResultSlots = 100
	aGapCapacity = 104
	aStageBytes  = 108
)

// struct fb_trigger_ctrl
const (
	cStopSeq     = 0
	cResultsRead = 8
	cError       = 16
	cErrorRecord = 20
	cErrorSeq    = 24
)

// struct fb_trigger_job
const (
	jData      = 0
	jSeq       = 8
	jPublishNs = 16
	jRecords   = 24
	jBytes     = 28
	jFlags     = 32
	jSources   = 36
)

// struct fb_trigger_result
const (
	rSeq1         = 0
	rPublishNs    = 8
	rBufferEnergy = 16
	rWindowEnergy = 24
	rRecords      = 32
	rFlags        = 36
	rGPUNs        = 40
)

// Result flags.
const (
	resultClosed    = 1
	resultTriggered = 2
)

// Kernel errors (fb_trigger_errors).
const (
	errSeq     = 1
	errDesc    = 2
	errRecord  = 3
	errTrailer = 4
	errGaps    = 5
)

// struct fb_trigger_state
const (
	stWindowEnergy = 0
	stWindows      = 8
	stTriggers     = 16
	stSourceSlots  = 24
	stGapsBefore   = 28
	stGapCount     = 32
	stFailed       = 36
	stBuffers      = 40
	stRecords      = 48
	stTurn         = 128
	stProfCycles   = 256 // [phases]uint64
	stProfRunCyc   = 312
	stProfRunNs    = 320

	phases = 7 // FB_TRIGGER_PHASES
)

// struct fb_trigger_source
const (
	sRecords         = 0
	sBytes           = 8
	sDroppedHere     = 16
	sSenderGaps      = 24
	sSenderBackwards = 32
	sShort           = 40
	sFirstRxNs       = 48
	sLastRxNs        = 56
	sNextRing        = 64
	sNextSeq         = 68
	sFirstSeq        = 72
	sLastSeq         = 76
	sHaveSeq         = 80
	sGaps            = 84
	sReassigned      = 88
	sGen             = 96
)

// struct fb_trigger_gap
const (
	gSeq    = 0
	gKey    = 8
	gSource = 12
	gSender = 14
	gWant   = 16
	gGot    = 20
)

// fb_ingest.h: what this package reads of the ring itself.
const (
	ingHeaderLen     = 4096
	ingDescSize      = 64
	ingRecordHeader  = 24
	ingPublished     = 128 // fb_ingest_header.published
	ingSourceCount   = 136 // fb_ingest_header.source_count
	ingProducerState = 140 // fb_ingest_header.producer_state
	ingBufferCount   = 24
	ingBufferSize    = 28
	ingDescOff       = 32
	ingMaxSources    = 48
	ingBuffersOff    = 56
	ingDState        = 0 // fb_ingest_desc.state
	ingDRecords      = 4
	ingDSeq          = 8
	ingDBytes        = 16
	ingDFlags        = 20
	ingDFirstNs      = 24
	ingDLastNs       = 32
	ingDPublishNs    = 48
	ingRSize         = 0 // fb_ingest_record.size
	ingRPayloadLen   = 4
	ingRSource       = 6
	ingRRxNs         = 8
	ingRSeq          = 16
	ingRSourceGen    = 20 // fb_ingest_record.source_gen, "reserved" before it had a name (REC_GEN)

	ingStateFree     = 0
	ingStateReady    = 1
	ingProducerClose = 2
	ingBufContinued  = 8
)
