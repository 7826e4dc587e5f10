/*
 * stepq version. This header is the single source of the version number:
 * meson.build reads the three defines below to set the project version,
 * the shared-library soversion and the pkg-config version.
 */
#ifndef STEPQ_VERSION_H
#define STEPQ_VERSION_H

#define STEPQ_VERSION_MAJOR 0
#define STEPQ_VERSION_MINOR 1
#define STEPQ_VERSION_PATCH 0

/** Encodes a version as one comparable integer (major << 16 | minor << 8 | patch). */
#define STEPQ_VERSION_ENCODE(major, minor, patch) (((major) << 16) | ((minor) << 8) | (patch))

#define STEPQ_VERSION_NUMBER \
    STEPQ_VERSION_ENCODE(STEPQ_VERSION_MAJOR, STEPQ_VERSION_MINOR, STEPQ_VERSION_PATCH)

#endif /* STEPQ_VERSION_H */
