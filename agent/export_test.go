package agent

// InspectKeep is how many entries the inspector keeps, for the tests of
// package agent_test.
const InspectKeep = inspectKeep
