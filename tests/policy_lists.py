"""What AWS and MinIO accept in an S3 policy, kept here with their sources (tests/test_policies.py).

Refresh them from the sources when a policy needs an action or condition key missing here.
"""

from __future__ import annotations

AWS_S3_ACTIONS_SOURCE = (
    "AWS Service Authorization Reference, 'Actions, resources, and condition keys for Amazon "
    "S3', table 'Actions defined by Amazon S3': https://docs.aws.amazon.com/service-authorization"
    "/latest/reference/list_amazons3.html (programmatic: https://servicereference.us-east-1."
    "amazonaws.com/v1/s3/s3.json)")
AWS_S3_ACTIONS = frozenset(f"s3:{name}" for name in """
AbortMultipartUpload AllowVendedLogDeliveryForResource AssociateAccessGrantsIdentityCenter
BypassGovernanceRetention CreateAccessGrant CreateAccessGrantsInstance
CreateAccessGrantsLocation CreateAccessPoint CreateAccessPointForObjectLambda CreateBucket
CreateBucketMetadataTableConfiguration CreateJob CreateMultiRegionAccessPoint
CreateStorageLensGroup DeleteAccessGrant DeleteAccessGrantsInstance
DeleteAccessGrantsInstanceResourcePolicy DeleteAccessGrantsLocation DeleteAccessPoint
DeleteAccessPointForObjectLambda DeleteAccessPointPolicy DeleteAccessPointPolicyForObjectLambda
DeleteBucket DeleteBucketMetadataTableConfiguration DeleteBucketPolicy DeleteBucketWebsite
DeleteJobTagging DeleteMultiRegionAccessPoint DeleteObject DeleteObjectAnnotation
DeleteObjectTagging DeleteObjectVersion DeleteObjectVersionAnnotation
DeleteObjectVersionTagging DeleteStorageLensConfiguration DeleteStorageLensConfigurationTagging
DeleteStorageLensGroup DescribeJob DescribeMultiRegionAccessPointOperation
DissociateAccessGrantsIdentityCenter GetAccelerateConfiguration GetAccessGrant
GetAccessGrantsInstance GetAccessGrantsInstanceForPrefix GetAccessGrantsInstanceResourcePolicy
GetAccessGrantsLocation GetAccessPoint GetAccessPointConfigurationForObjectLambda
GetAccessPointForObjectLambda GetAccessPointPolicy GetAccessPointPolicyForObjectLambda
GetAccessPointPolicyStatus GetAccessPointPolicyStatusForObjectLambda
GetAccountPublicAccessBlock GetAnalyticsConfiguration GetBucketAbac GetBucketAcl GetBucketCORS
GetBucketLocation GetBucketLogging GetBucketMetadataTableConfiguration GetBucketNotification
GetBucketObjectLockConfiguration GetBucketOwnershipControls GetBucketPolicy
GetBucketPolicyStatus GetBucketPublicAccessBlock GetBucketRequestPayment GetBucketTagging
GetBucketVersioning GetBucketWebsite GetDataAccess GetEncryptionConfiguration
GetIntelligentTieringConfiguration GetInventoryConfiguration GetJobTagging
GetLifecycleConfiguration GetMetricsConfiguration GetMultiRegionAccessPoint
GetMultiRegionAccessPointPolicy GetMultiRegionAccessPointPolicyStatus
GetMultiRegionAccessPointRoutes GetObject GetObjectAcl GetObjectAnnotation GetObjectAttributes
GetObjectLegalHold GetObjectRetention GetObjectTagging GetObjectTorrent GetObjectVersion
GetObjectVersionAcl GetObjectVersionAnnotation GetObjectVersionAnnotationForReplication
GetObjectVersionAttributes GetObjectVersionForReplication GetObjectVersionTagging
GetObjectVersionTorrent GetReplicationConfiguration GetStorageLensConfiguration
GetStorageLensConfigurationTagging GetStorageLensDashboard GetStorageLensGroup
InitiateReplication ListAccessGrants ListAccessGrantsInstances ListAccessGrantsLocations
ListAccessPoints ListAccessPointsForObjectLambda ListAllMyBuckets ListBucket
ListBucketMultipartUploads ListBucketVersions ListCallerAccessGrants ListJobs
ListMultiRegionAccessPoints ListMultipartUploadParts ListObjectAnnotations
ListObjectVersionAnnotations ListStorageLensConfigurations ListStorageLensGroups
ListTagsForResource ObjectOwnerOverrideToBucketOwner PauseReplication
PutAccelerateConfiguration PutAccessGrantsInstanceResourcePolicy
PutAccessPointConfigurationForObjectLambda PutAccessPointPolicy
PutAccessPointPolicyForObjectLambda PutAccessPointPublicAccessBlock
PutAccountPublicAccessBlock PutAnalyticsConfiguration PutBucketAbac PutBucketAcl PutBucketCORS
PutBucketLogging PutBucketNotification PutBucketObjectLockConfiguration
PutBucketOwnershipControls PutBucketPolicy PutBucketPublicAccessBlock PutBucketRequestPayment
PutBucketTagging PutBucketVersioning PutBucketWebsite PutEncryptionConfiguration
PutIntelligentTieringConfiguration PutInventoryConfiguration PutJobTagging
PutLifecycleConfiguration PutMetricsConfiguration PutMultiRegionAccessPointPolicy PutObject
PutObjectAcl PutObjectAnnotation PutObjectLegalHold PutObjectRetention PutObjectTagging
PutObjectVersionAcl PutObjectVersionAnnotation PutObjectVersionTagging
PutReplicationConfiguration PutStorageLensConfiguration PutStorageLensConfigurationTagging
ReplicateDelete ReplicateObject ReplicateObjectAnnotation ReplicateTags RestoreObject
SubmitMultiRegionAccessPointRoutes TagResource UntagResource UpdateAccessGrantsLocation
UpdateBucketMetadataAnnotationTableConfiguration UpdateBucketMetadataInventoryTableConfiguration
UpdateBucketMetadataJournalTableConfiguration UpdateJobPriority UpdateJobStatus
UpdateObjectEncryption UpdateStorageLensGroup
""".split())

AWS_S3_CONDITION_KEYS_SOURCE = (
    "the same reference, table 'Condition keys for Amazon S3' (s3:prefix: ListBucket), and "
    "'Enforce conditional writes on Amazon S3 buckets': https://docs.aws.amazon.com/AmazonS3/"
    "latest/userguide/conditional-writes-enforce.html (s3:if-none-match: PutObject)")
AWS_S3_CONDITION_KEYS = {"s3:ListBucket": {"s3:prefix", "s3:delimiter", "s3:max-keys"},
                         "s3:PutObject": {"s3:if-none-match", "s3:if-match"}}
"""The condition keys of the actions our policies put conditions on (a subset of the table)."""

MINIO_SOURCE = (
    "MinIO's policy package, github.com/minio/pkg policy/action.go (supportedActions, "
    "supportedObjectActions, IAMActionConditionKeyMap) and policy/condition/keyname.go "
    "(CommonKeys); MinIO refuses a policy with any other action ('unsupported action') or a "
    "condition key the action does not take ('unsupported condition keys')")
MINIO_ACTIONS = frozenset(f"s3:{name}" for name in """
AbortMultipartUpload CreateBucket DeleteBucket ForceDeleteBucket DeleteBucketPolicy
DeleteBucketCors DeleteObject GetBucketLocation GetBucketNotification GetBucketPolicy
GetBucketCors GetObject HeadBucket ListAllMyBuckets ListBucket GetBucketPolicyStatus
ListBucketVersions ListBucketMultipartUploads ListenNotification ListenBucketNotification
ListMultipartUploadParts PutLifecycleConfiguration GetLifecycleConfiguration
PutBucketNotification PutBucketPolicy PutBucketCors PutBucketQOS GetBucketQOS PutObject
BypassGovernanceRetention PutObjectRetention GetObjectRetention GetObjectLegalHold
PutObjectLegalHold GetBucketObjectLockConfiguration PutBucketObjectLockConfiguration
GetBucketTagging PutBucketTagging GetObjectVersion GetObjectAttributes
GetObjectVersionAttributes GetObjectVersionTagging DeleteObjectVersion
DeleteObjectVersionTagging PutObjectVersionTagging GetObjectTagging PutObjectTagging
DeleteObjectTagging PutEncryptionConfiguration GetEncryptionConfiguration PutBucketVersioning
GetBucketVersioning GetReplicationConfiguration PutReplicationConfiguration ReplicateObject
ReplicateDelete ReplicateTags GetObjectVersionForReplication RestoreObject
ResetBucketReplicationState PutObjectFanOut *
""".split())
MINIO_OBJECT_ACTIONS = frozenset(f"s3:{name}" for name in """
AbortMultipartUpload DeleteObject GetObject ListMultipartUploadParts PutObject
BypassGovernanceRetention PutObjectRetention GetObjectRetention PutObjectLegalHold
GetObjectLegalHold GetObjectTagging PutObjectTagging DeleteObjectTagging GetObjectVersion
GetObjectVersionTagging DeleteObjectVersion DeleteObjectVersionTagging PutObjectVersionTagging
ReplicateObject ReplicateDelete ReplicateTags GetObjectVersionForReplication RestoreObject
ResetBucketReplicationState PutObjectFanOut GetObjectAttributes GetObjectVersionAttributes
""".split())
MINIO_COMMON_KEYS = frozenset("""
s3:signatureversion s3:authType s3:signatureAge s3:x-amz-content-sha256 s3:LocationConstraint
aws:Referer aws:SourceIp aws:UserAgent aws:SecureTransport aws:CurrentTime aws:EpochTime
aws:principaltype aws:userid aws:username aws:groups ldap:user ldap:username ldap:groups
""".split())
MINIO_CONDITION_KEYS = {
    "s3:ListBucket": MINIO_COMMON_KEYS | {"s3:prefix", "s3:delimiter", "s3:max-keys"},
    "s3:GetObject": MINIO_COMMON_KEYS | {"s3:x-amz-server-side-encryption", "s3:versionid",
                                         "s3:x-amz-server-side-encryption-customer-algorithm",
                                         "s3:x-amz-server-side-encryption-aws-kms-key-id",
                                         "s3:ExistingObjectTag"},
    "s3:PutObject": MINIO_COMMON_KEYS | {"s3:x-amz-copy-source", "s3:x-amz-server-side-encryption",
                                         "s3:x-amz-server-side-encryption-customer-algorithm",
                                         "s3:x-amz-server-side-encryption-aws-kms-key-id",
                                         "s3:x-amz-metadata-directive", "s3:x-amz-storage-class",
                                         "s3:versionid", "s3:object-lock-retain-until-date",
                                         "s3:object-lock-mode", "s3:object-lock-legal-hold",
                                         "s3:RequestObjectTagKeys", "s3:RequestObjectTag"}}
"""The keys MinIO accepts for the actions our policies use (no ``s3:if-none-match``)."""
